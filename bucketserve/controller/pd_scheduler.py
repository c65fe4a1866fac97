"""The P/D scheduler: which decode worker reserves blocks for the next prefill batch, which
prefill worker runs it, and how many blocks that takes. Torch-free and synchronous; every
decision is a return value, so the service's Controller and the simulator drive the same code.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from bucketserve.bucket_manager.prefill_batch import PrefillBatch
from bucketserve.bucket_manager.request import BucketRequest


class PDScheduler:
    """Decode workers are numbered 0..n-1 and report their *room* (blocks a new batch may
    take) and *load* (sequences running or waiting) with `update`; `pick_decode` returns the
    one with the most room, among equals the least loaded, then the lowest number.

    The rooms sit in a max-heap, re-pushed on every update and skipped lazily when stale,
    so a pick is O(log n) rather than a scan of every worker, which the simulator's
    hundreds of decode workers would pay on every batch.
    """

    def __init__(self, num_decode: int, block_size: int) -> None:
        if num_decode < 1:
            raise ValueError("the P/D scheduler needs at least one decode worker")
        self.block_size = block_size
        self._version = [0] * num_decode
        self._heap: list[tuple[int, int, int, int]] = []

    # -- decode side -------------------------------------------------------------------------

    def update(self, worker: int, room: int, load: int) -> None:
        """Decode worker `worker`'s room or load changed: file it under the new values."""
        self._version[worker] += 1
        heapq.heappush(self._heap, (-room, load, worker, self._version[worker]))
        if len(self._heap) > 4 * len(self._version) + 64:
            self._heap = [e for e in self._heap if e[3] == self._version[e[2]]]
            heapq.heapify(self._heap)

    def remove(self, worker: int) -> None:
        """`worker` takes no batches until its next `update` (it died)."""
        self._version[worker] += 1

    def pick_decode(self) -> int | None:
        """The decode worker with the most room; None when none is filed."""
        heap = self._heap
        while heap and heap[0][3] != self._version[heap[0][2]]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    # -- prefill side ------------------------------------------------------------------------

    @staticmethod
    def pick_prefill(free_blocks: Sequence[int], inflight: Sequence[int], limit: int) -> int | None:
        """The prefill worker (by position) with fewer than `limit` batches in flight and the
        most free blocks, among equals the fewer batches in flight; None when all are busy."""
        open_ = [i for i, n in enumerate(inflight) if n < limit]
        if not open_:
            return None
        return max(open_, key=lambda i: (free_blocks[i], -inflight[i]))

    # -- block accounting --------------------------------------------------------------------

    def blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def need(self, batch: PrefillBatch) -> list[tuple[str, int]]:
        """(request id, blocks its prompt takes) for each request of `batch`, in order."""
        return [(r.request_id, self.blocks(r.prompt_len)) for r in batch.requests]

    def decode_need(self, batch: PrefillBatch) -> list[tuple[str, int]]:
        """`need` of the requests whose KV goes on to a decode worker: not those that end at
        their first token."""
        return [
            (r.request_id, self.blocks(r.prompt_len))
            for r in batch.requests
            if not self.ends_at_prefill(r)
        ]

    @staticmethod
    def ends_at_prefill(request: BucketRequest) -> bool:
        """One sample with one token left to plan for (`max_tokens` left, or the room to
        the model's length): the prefill's token ends it, whatever it is."""
        return request.samples == 1 and request.max_tokens == 1

    @staticmethod
    def fork_blocks(batch: PrefillBatch) -> int:
        """Blocks the decode side takes at once for the extra samples of n > 1 requests: each
        shares the prompt's full blocks (counted once, in `need`) and copies the last one."""
        return sum(r.samples - 1 for r in batch.requests)

    def split_for_pool(
        self, batch: PrefillBatch, free_blocks: int
    ) -> tuple[PrefillBatch | None, PrefillBatch | None]:
        """(head, rest): the longest head of `batch` whose prompts fit `free_blocks` of a
        prefill pool, and what goes back to the queue; either may be None."""
        used, n = 0, 0
        for request in batch.requests:
            used += self.blocks(request.prompt_len)
            if used > free_blocks:
                break
            n += 1
        head = subset(batch, list(range(n))) if n else None
        rest = subset(batch, list(range(n, len(batch)))) if n < len(batch) else None
        return head, rest


def subset(batch: PrefillBatch, keep: list[int]) -> PrefillBatch:
    """`batch` with only the requests at positions `keep`."""
    return dataclasses.replace(
        batch,
        requests=tuple(batch.requests[i] for i in keep),
        order_keys=tuple(batch.order_keys[i] for i in keep),
        kv_blocks_per_request=tuple(batch.kv_blocks_per_request[i] for i in keep),
    )
