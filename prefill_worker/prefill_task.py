"""What the controller hands a prefill worker and what comes back (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deploy.worker_messages import HandoffRequest, TokenDelta, WorkerStats
from kv_transfer.kv_format import KVBlockHandle


@dataclass
class PrefillTask:
    """One prefill batch: its requests in order, the prompt shape bucket it pads to
    (`graph_miss`: none fits, it runs unpadded) and the decode lease its KV goes to.
    `max_seq_len` is the decode side's bound on prompt + output."""

    batch_id: int
    requests: list[HandoffRequest]
    shape: tuple[int, int, int]
    graph_miss: bool
    target: KVBlockHandle
    max_seq_len: int


@dataclass
class PrefillResult:
    """The batch's first tokens (`first[i]` for `requests[i]`) and the transport payload the
    decode worker pulls the KV with. The prefill blocks stay held under `lease_id` until
    `release(lease_id)` acknowledges the handoff."""

    batch_id: int
    worker: str
    lease_id: str
    first: list[TokenDelta]
    payload: Any
    pad_to: tuple[int, int, int] | None
    compute_s: float  # the forward pass, layer hooks excluded
    send_s: float  # exporting and sending the layer chunks
    kv_bytes: int
    stats: WorkerStats
