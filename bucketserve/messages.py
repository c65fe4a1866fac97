"""Every message that crosses a process (or package) boundary, in one module (torch-free,
picklable).

gateway -> controller: ServeRequest; controller -> gateway: StreamDelta (with RequestTimings),
ModelInfo, ServiceStats, and the admission errors. controller <-> prefill worker: PrefillTask,
PrefillResult. controller <-> decode worker: Reservation, AdmitResult, StepOutput. Both
workers: WorkerRequest (the ServeRequest with its tokens so far), TokenDelta, WorkerStats.
A ServeRequest is made once, at admission; the controller, the bucket manager's queue and
the workers refer to that one object rather than copying its fields.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bucketserve.bucket_manager.monitor import BucketMetrics
from bucketserve.kv_transfer.kv_format import KVBlockHandle
from bucketserve.runtime.core.block_manager import TenantCacheStats
from bucketserve.runtime.core.logprobs import TokenLogprob
from bucketserve.runtime.core.outputs import RequestOutput
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import FinishReason
from bucketserve.runtime.core.tenant_tag import DEFAULT_TENANT, TenantTag
from bucketserve.runtime.io.tokenizer import Tokenizer

# -- gateway <-> controller ----------------------------------------------------------------


@dataclass
class ServeRequest:
    """A tokenized, validated request. `arrival_time` is `time.monotonic()`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    tenant: str = "default"
    priority: int = 0  # lower is served first, as in vLLM
    prompt_text: str | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None  # narrows the tenant's prefix-cache domain (vLLM's field)


@dataclass
class RequestTimings:
    """Seconds spent in each stage; filled in as the request moves on."""

    queue_s: float = 0.0  # arrival until its prefill batch was dispatched
    prefill_s: float = 0.0  # the prefill batch's compute
    transfer_s: float = 0.0  # moving its KV blocks to the decode worker
    first_token_s: float = 0.0  # arrival until the first token reached the controller (TTFT)
    decode_s: float = 0.0  # first token until the last


@dataclass
class StreamDelta:
    """New tokens of one request's sample `index` since its previous delta.

    The final delta has `finished=True`, a `finish_reason` (stop / length /
    cancelled / error), usage counts, timings and the buckets that served it;
    `error` says what went wrong when the reason is `error`. With n > 1 samples
    each sample's last delta has its `finish_reason` (and `num_output_tokens`, its
    token count); the request's final delta is the last of them and counts every
    sample's tokens. `prompt_logprobs` (when asked for) come once, one per prompt
    token, the first None.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob | None] | None = None  # one per token, when asked for
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    timings: RequestTimings | None = None
    request_bucket: tuple[int, int] | None = None  # [low, up) prompt-length range
    shape_bucket: tuple[int, int, int] | None = None  # (batch, query, blocks) of its prefill
    index: int = 0  # the sample (choice) of an n > 1 request
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # of the prompt's, found in a prefix cache (usage, as vLLM's)
    prefill_path: str | None = None  # final delta: local (its decode worker) or remote


class ServiceError(Exception):
    """An admission failure the gateway maps to a status code."""


class QueueFullError(ServiceError):
    """The service queue is at its bound (RESOURCE_EXHAUSTED / HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SloShedError(QueueFullError):
    """The queue ahead would make the request miss its TTFT target: refused at once
    (`shed: predicted`), RESOURCE_EXHAUSTED / HTTP 429 with the seconds to retry after."""


class NoWorkersError(ServiceError):
    """No live prefill or decode worker can take the request (UNAVAILABLE / HTTP 503)."""


@dataclass(frozen=True)
class ModelInfo:
    """`max_model_len` bounds prompt + output; `max_prompt_len` is the longest prompt
    the service admits (the decode pool bounds it too)."""

    name: str
    path: Path
    max_model_len: int
    max_prompt_len: int
    block_size: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    tokenizer: Tokenizer
    tool_call_parser: str | None = None


@dataclass
class ServiceStats:
    """`waiting`: queued for prefill; `running`: dispatched (prefilling, moving KV or
    decoding). Worker figures are their latest reports."""

    waiting: int
    running: int
    workers: list[WorkerStats]
    buckets: BucketMetrics
    requests_total: int = 0
    requests_finished: int = 0
    requests_requeued: int = 0
    kv_bytes_moved: int = 0
    transfers: int = 0
    transfer_s: float = 0.0  # KV send + receive time, summed over transfers
    worker_restarts: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    requests_shed: dict[str, int] = field(default_factory=dict)  # by tenant (SloShedError)
    prefill_paths: dict[str, int] = field(default_factory=dict)  # local / remote prefills

    def worker(self, name: str) -> WorkerStats:
        for stats in self.workers:
            if stats.name == name:
                return stats
        raise KeyError(f"no worker named {name!r}; workers: {[w.name for w in self.workers]}")

    @property
    def kv_blocks_leaked(self) -> int:
        """Blocks not free on any worker: 0 once the service has drained."""
        return sum(w.num_total_blocks - w.num_free_blocks for w in self.workers)

    @property
    def leases_open(self) -> int:
        return sum(w.leases_open for w in self.workers)


# -- controller <-> workers ---------------------------------------------------------------


@dataclass
class WorkerRequest:
    """The admitted request as a worker's engine takes it, in either shape: what a prefill
    worker computes, what a decode worker continues after a handoff, and what a colocated
    worker's engine prefills and decodes itself. `request` is the ServeRequest admission
    made (shared, never copied or changed); `output_token_ids` is a snapshot of the
    generated tokens: none for a fresh prompt; on admission after a handoff, everything
    generated, ending with the token the prefill just sampled.
    """

    request: ServeRequest
    output_token_ids: list[int]
    # its rank in the bucket manager's order, compared in order: the tenant's priority,
    # then the request's own (the engine's priority policy applies it; lower first)
    priority: tuple[int, int] = (0, 0)
    # seconds left, when sent, until its first token is due (its TTFT target, the
    # request's or its tenant's); None without a target or once it has streamed a token.
    # A duration, not a time: the worker's clock may be another node's.
    ttft_left_s: float | None = None
    tpot_s: float | None = None  # its TPOT target (the request's or its tenant's)
    tenant: TenantTag = DEFAULT_TENANT  # fair share and prefix-cache domain

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class TokenDelta:
    """New token ids of one request, with where they start in its output, so a receiver that
    already has some of them (after a re-prefill) can skip those. Token ids only: text and
    stop strings are the controller's output processor's."""

    request_id: str
    token_offset: int
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob | None] | None = None  # one per token, when asked for
    index: int = 0  # the sample (choice) of an n > 1 request
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, when asked for
    # prompt tokens the worker found in its prefix cache: with the request's first token
    num_cached_tokens: int | None = None


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
    slo_holds: int = 0  # steps whose SLO-aware admission held a new prompt back
    paced_s: float = 0.0  # seconds decode steps waited for a prefill (DecodeWorkerConfig.pace)
    graph_misses: int = 0
    boot_id: str = ""
    alive: bool = True
    restarts: int = 0
    leases_open: int = 0
    leases_expired: int = 0
    reserved_blocks: int = 0
    blocks_to_come: int = 0  # free blocks that queued prompts (and their rest) will take
    batches: int = 0  # prefill batches run, or decode steps taken
    kv_bytes_sent: int = 0
    transport: str = ""  # the KV transport in use
    pipeline_stages: int = 1  # stages of the worker's group (one card each)
    microbatches_in_flight: int = 0
    bubble_fraction: float = 0.0  # stage time idle while the group had work, since start
    execution: str = ""  # eager | graphs
    graphs: int = 0  # compiled step graphs held (graphs mode)
    graph_compile_s: float = 0.0  # warm-up's compile seconds
    graph_miss_compile_s: float = 0.0  # compile seconds of shapes met while serving
    kv_export: str = ""  # graphs mode: per_layer, or after_graph where a graph runs whole
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found cached
    tenant_cache: dict[str, TenantCacheStats] = field(default_factory=dict)  # by tenant
    # what computing prompts costs it, as measured (None until measured): seconds per prompt
    # token, and (an engine that prefills within its decode steps) a decode step's seconds
    prefill_token_s: float | None = None
    decode_step_s: float | None = None
    prompt_tokens_to_come: int = 0  # prompt tokens queued or in progress, not yet computed
    tpot_slack_s: float | None = None  # the least its running requests' TPOTs can absorb


@dataclass
class StepOutput:
    """Everything one decode step produced: one message per step."""

    worker: str
    boot_id: str
    step: int
    deltas: list[TokenDelta]
    stats: WorkerStats
    time: float = field(default_factory=time.monotonic)


@dataclass
class PrefillTask:
    """One prefill batch: its requests in order, the prompt shape bucket it pads to
    (`graph_miss`: none fits, it runs unpadded) and the decode lease its KV goes to, which
    names the requests that go on to decode in order (None: every one ends at its first
    token). `max_seq_len` is the decode side's bound on prompt + output."""

    batch_id: int
    requests: list[WorkerRequest]
    shape: tuple[int, int, int]
    graph_miss: bool
    target: KVBlockHandle | None
    max_seq_len: int


@dataclass
class PrefillResult:
    """The batch's first tokens (`first[i]` for `requests[i]`) and the transport payload the
    decode worker pulls the KV with. The prefill blocks stay held under `lease_id` until
    `release(lease_id)` acknowledges the handoff (None with no target: nothing is held)."""

    batch_id: int
    worker: str
    lease_id: str | None
    first: list[TokenDelta]
    payload: Any
    pad_to: tuple[int, int, int] | None
    compute_s: float  # the forward pass, layer hooks excluded
    send_s: float  # exporting and sending the layer chunks
    kv_bytes: int
    stats: WorkerStats


class ReservationError(RuntimeError):
    """Not enough free blocks for the reservation; nothing was reserved."""


@dataclass
class Reservation:
    """Blocks held for a prefill batch's KV: `handle` tells the prefill where to send it."""

    handle: KVBlockHandle
    ttl_s: float
    stats: WorkerStats

    @property
    def lease_id(self) -> str:
        return self.handle.lease_id


@dataclass
class AdmitResult:
    """`admitted` joined the running batch; `rejected[id]` says why one did not."""

    admitted: list[str]
    rejected: dict[str, str] = field(default_factory=dict)
    receive_s: float = 0.0
    kv_bytes: int = 0
    stats: WorkerStats | None = None


def deltas_of(out: RequestOutput) -> list[TokenDelta]:
    """One TokenDelta per sample with news (n = 1: always its one), the prompt's logprobs
    with sample 0's first tokens."""
    single = len(out.outputs) == 1
    deltas = []
    for o in out.outputs:
        if not (o.changed or single):
            continue
        reason = o.finish_reason
        offset = len(o.token_ids) - len(o.delta_token_ids)
        first = o.index == 0 and offset == 0 and bool(o.delta_token_ids)
        deltas.append(
            TokenDelta(
                request_id=out.request_id,
                token_offset=offset,
                token_ids=list(o.delta_token_ids),
                finished=o.finished,
                finish_reason=None if reason is None else reason.value,
                error="the model runner failed on this request"
                if reason == FinishReason.ERROR
                else None,
                logprobs=None if o.delta_logprobs is None else list(o.delta_logprobs),
                index=o.index,
                prompt_logprobs=out.prompt_logprobs if first else None,
                num_cached_tokens=out.num_cached_tokens if first else None,
            )
        )
    return deltas
