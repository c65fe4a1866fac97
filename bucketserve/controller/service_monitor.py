"""The global monitor's counters: requests in and out, re-queues, KV moved, finish reasons;
with the workers' and the bucket manager's latest reports they make the ServiceStats."""

from __future__ import annotations

from collections import Counter

from bucketserve.bucket_manager.monitor import BucketMetrics
from bucketserve.messages import ServiceStats, WorkerStats


class ServiceMonitor:
    """Counts since the controller started (torch-free)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.shed: Counter[str] = Counter()  # tenant -> requests refused as predicted late
        self.prefill_paths: Counter[str] = Counter()  # local / remote -> requests dispatched
        self.transfer_s = 0.0  # KV send + receive time, summed over transfers

    def submitted(self) -> None:
        self.counts["requests_total"] += 1

    def finished(self, reason: str) -> None:
        self.counts["requests_finished"] += 1
        self.reasons[reason] += 1

    def requeued(self) -> None:
        self.counts["requests_requeued"] += 1

    def sent(self, kv_bytes: int, send_s: float) -> None:
        """One prefill batch's KV went out."""
        self.counts["kv_bytes"] += kv_bytes
        self.counts["transfers"] += 1
        self.transfer_s += send_s

    def received(self, receive_s: float) -> None:
        self.transfer_s += receive_s

    def stats(
        self,
        waiting: int,
        running: int,
        workers: list[WorkerStats],
        buckets: BucketMetrics,
        worker_restarts: int,
    ) -> ServiceStats:
        c = self.counts
        return ServiceStats(
            waiting=waiting,
            running=running,
            workers=workers,
            buckets=buckets,
            requests_total=c["requests_total"],
            requests_finished=c["requests_finished"],
            requests_requeued=c["requests_requeued"],
            kv_bytes_moved=c["kv_bytes"],
            transfers=c["transfers"],
            transfer_s=self.transfer_s,
            worker_restarts=worker_restarts,
            finish_reasons=dict(self.reasons),
            requests_shed=dict(self.shed),
            prefill_paths=dict(self.prefill_paths),
        )
