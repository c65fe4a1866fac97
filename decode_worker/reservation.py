"""A decode worker's answers to the controller: a reservation, an admission (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from deploy.worker_messages import WorkerStats
from kv_transfer.kv_format import KVBlockHandle


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
