"""Which decode worker a prefill batch goes to, and the reservation of its blocks there.

The choice is a stand-in with the DESIGN's rule (most room first, then least loaded)
until the service's own P/D scheduler exists as a torch-free class the simulator can
drive; the reservation is the service's own lease table (kv_transfer.lease).

The workers sit in a max-heap by room, re-pushed whenever a worker's room changes and
skipped lazily when stale, so a pick is O(log n) rather than a scan of every worker
(the scan cost 1 ms a batch at 500 decode workers). Among equal rooms the worker that
was least loaded when its room last changed goes first.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from benchmarks.simulator.decode_worker import DecodeWorker
from bucket_manager import PrefillBatch
from kv_transfer.lease import Lease


class PDScheduler:
    def __init__(self, workers: Sequence[DecodeWorker]) -> None:
        if not workers:
            raise ValueError("the P/D scheduler needs at least one decode worker")
        self.workers = list(workers)
        self._version = [0] * len(self.workers)
        self._heap: list[tuple[int, int, int, int]] = []
        for worker in self.workers:
            worker.on_room_change = self.update
            self.update(worker)

    def update(self, worker: DecodeWorker) -> None:
        """`worker`'s room or load changed: file it again under its new room."""
        i = worker.index
        self._version[i] += 1
        heapq.heappush(self._heap, (-worker.room, worker.load, i, self._version[i]))
        if len(self._heap) > 4 * len(self.workers) + 64:
            self._heap = [e for e in self._heap if e[3] == self._version[e[2]]]
            heapq.heapify(self._heap)

    def pick(self) -> DecodeWorker:
        """The worker with the most room."""
        heap = self._heap
        while heap[0][3] != self._version[heap[0][2]]:
            heapq.heappop(heap)
        return self.workers[heap[0][2]]

    def reserve(self, worker: DecodeWorker, batch: PrefillBatch) -> Lease | None:
        """Hold the batch's blocks on `worker` under one lease (kv_transfer's LeaseTable);
        None when they are not free (prompt-only accounting leaves out the first token)."""
        requests = batch.requests
        if not worker.can_reserve([r.prompt_len for r in requests]):
            return None
        return worker.reserve(
            [r.request_id for r in requests],
            [r.prompt_len for r in requests],
            batch.kv_blocks_per_request,
        )
