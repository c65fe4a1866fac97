"""The small dataclasses workers and the controller exchange (torch-free, picklable)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from runtime.sampling_params import SamplingParams


@dataclass
class HandoffRequest:
    """A request's tokens so far: what a prefill computes and a decode worker continues.

    `output_token_ids` are generated tokens: none for a fresh prompt going to
    prefill; on admission to decode, everything generated, ending with the
    token the prefill just sampled.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class TokenDelta:
    """New tokens (and text) of one request, with where they start in its output, so a
    receiver that already has some of them (after a re-prefill) can skip those."""

    request_id: str
    token_offset: int
    token_ids: list[int]
    text_offset: int = 0
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class WorkerStats:
    """One worker's KV pool and load, as its last report showed them."""

    name: str
    role: str  # "prefill" or "decode"
    node_id: str
    num_free_blocks: int
    num_total_blocks: int
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    graph_misses: int = 0
    boot_id: str = ""
    alive: bool = True
    restarts: int = 0
    leases_open: int = 0
    leases_expired: int = 0
    reserved_blocks: int = 0
    batches: int = 0  # prefill batches run, or decode steps taken
    kv_bytes_sent: int = 0
    transport: str = ""  # the KV transport in use


@dataclass
class StepOutput:
    """Everything one decode step produced: one message per step."""

    worker: str
    boot_id: str
    step: int
    deltas: list[TokenDelta]
    stats: WorkerStats
    time: float = field(default_factory=time.monotonic)
