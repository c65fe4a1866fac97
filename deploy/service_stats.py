"""What `Controller.stats()` reports (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bucket_manager.monitor import BucketMetrics
from deploy.worker_messages import WorkerStats


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
