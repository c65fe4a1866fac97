"""The DistServe-like baseline's batcher: one FCFS queue, no request buckets.

A prefill batch is the longest FCFS prefix whose prompts' K/V fits the decode worker's
room, of at most `max_num_seqs` prompts and `max_batched_tokens` padded tokens (every row
padded to the batch's longest prompt). Only the prompt's blocks are reserved, as in
vLLM-style decode pools; growth is met by preemption on the decode worker.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Hashable

from bucketserve.bucket_manager import BucketRequest, PrefillBatch
from bucketserve.bucket_manager.waste import padded_waste, waste_ratio
from bucketserve.utils.checks import check_int


class FcfsBatcher:
    def __init__(self, max_num_seqs: int, max_len: int, max_batched_tokens: int | None = None):
        check_int("max_num_seqs", max_num_seqs, 1)
        check_int("max_len", max_len, 2)
        self.max_num_seqs = max_num_seqs
        self.max_len = max_len
        self.max_batched_tokens = max_batched_tokens or math.inf
        self._queue: deque[BucketRequest] = deque()
        self._ids: set[Hashable] = set()
        self._batch_ids = itertools.count()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, request: BucketRequest) -> None:
        if request.request_id in self._ids:
            raise ValueError(f"request {request.request_id!r} is already queued")
        if request.prompt_len >= self.max_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt length {request.prompt_len} must be "
                f"below max_len {self.max_len}"
            )
        self._ids.add(request.request_id)
        self._queue.append(request)

    def requeue(self, batch: PrefillBatch) -> None:
        """Put a batch back at the head, in its order (its reservation failed)."""
        for request in batch.requests:
            if request.request_id in self._ids:
                raise ValueError(f"request {request.request_id!r} is already queued")
        for request in reversed(batch.requests):
            self._ids.add(request.request_id)
            self._queue.appendleft(request)

    def next_batch(self, free_blocks: int, block_size: int, now: float) -> PrefillBatch | None:
        chosen: list[BucketRequest] = []
        blocks: list[int] = []
        longest = 0
        for request in self._queue:
            need = -(-(request.prompt_len + 1) // block_size)
            longest_if = max(longest, request.prompt_len)
            fits = sum(blocks) + need <= free_blocks
            small = (len(chosen) + 1) * longest_if <= self.max_batched_tokens or not chosen
            if len(chosen) == self.max_num_seqs or not fits or not small:
                break
            chosen.append(request)
            blocks.append(need)
            longest = longest_if
        if not chosen:
            return None
        for request in chosen:
            self._queue.popleft()
            self._ids.discard(request.request_id)
        lengths = [r.prompt_len for r in chosen]
        return PrefillBatch(
            batch_id=next(self._batch_ids),
            tenant=chosen[0].tenant,
            requests=tuple(chosen),
            bucket=(0, self.max_len),
            shape=(len(chosen), longest, 0),
            graph_miss=False,
            kv_blocks_per_request=tuple(blocks),
            block_size=block_size,
            waste_ratio=waste_ratio(lengths),
            padded_waste=padded_waste(lengths, longest),
            shape_waste=padded_waste(lengths, longest),
            padded_tokens=len(chosen) * longest,
            order_keys=tuple((r.arrival_time,) for r in chosen),
        )
