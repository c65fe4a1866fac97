"""Algorithm 1 of BucketServe: request buckets that split under load and merge when it drops."""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from bucketserve.bucket_manager.config import RequestBucketConfig
from bucketserve.bucket_manager.policy import OrderKey
from bucketserve.bucket_manager.request import BucketRequest
from bucketserve.bucket_manager.request_bucket import RequestBucket
from bucketserve.bucket_manager.waste import expected_waste_of_buckets


class AdaptiveBuckets:
    """Contiguous buckets covering `[0, max_len)` of the lengths requests compute (their
    prompts less the cached prefix expected).

    `shape_edges` are the warmed prompt query lengths; with
    `config.shape_edge_snap > 0` a split lands on one of them when it is close
    to the midpoint, so the lower half's batches pad to at most that edge
    instead of straddling it.
    """

    def __init__(self, config: RequestBucketConfig, shape_edges: Sequence[int] = ()) -> None:
        self.config = config
        self.shape_edges = sorted(set(shape_edges))
        self.buckets = [RequestBucket(0, config.max_len)]
        self._uppers = [config.max_len]
        self.splits = 0
        self.merges = 0

    def __len__(self) -> int:
        return sum(len(b) for b in self.buckets)

    def __iter__(self) -> Iterator[RequestBucket]:
        return iter(self.buckets)

    @property
    def boundaries(self) -> list[int]:
        return [0, *self._uppers]

    def check_length(self, length: int) -> None:
        if not 0 <= length < self.config.max_len:
            raise ValueError(
                f"prompt length {length} is outside the request buckets [0, "
                f"{self.config.max_len}); raise RequestBucketConfig.max_len or shorten the prompt"
            )

    def find(self, length: int) -> RequestBucket:
        """The first bucket whose upper bound exceeds `length` (a bisection: O(log k))."""
        if not 0 <= length < self.config.max_len:
            self.check_length(length)
        return self.buckets[bisect.bisect_right(self._uppers, length)]

    def push(self, key: OrderKey, request: BucketRequest) -> None:
        self.find(request.effective_len).push(key, request)

    def adjust(self, n_max: int) -> int:
        """ADJUSTBUCKETS; returns how many buckets were split (-1 when all merged)."""
        if len(self) < n_max:
            if len(self.buckets) == 1:
                return 0
            self._replace(RequestBucket.merge(self.buckets))
            self.merges += 1
            return -1
        room = self.config.max_buckets - len(self.buckets)
        to_split = [b for b in self.buckets if self._should_split(b, n_max)][:room]
        for bucket in to_split:
            self._split(bucket)
        return len(to_split)

    def _should_split(self, bucket: RequestBucket, n_max: int) -> bool:
        size = len(bucket)
        if size <= n_max or bucket.up - bucket.low < 2:
            return False
        return bucket.count_below(bucket.midpoint) / size > self.config.theta

    def split_point(self, bucket: RequestBucket) -> int:
        """The midpoint, or the warmed shape edge nearest to it (ties: the higher) when close."""
        mid = bucket.midpoint
        reach = self.config.shape_edge_snap * (bucket.up - bucket.low)
        near = [e for e in self.shape_edges if bucket.low < e < bucket.up and abs(e - mid) <= reach]
        return min(near, key=lambda e: (abs(e - mid), -e)) if near else mid

    def _split(self, bucket: RequestBucket) -> None:
        index = self.buckets.index(bucket)
        self.buckets[index : index + 1] = bucket.split(self.split_point(bucket))
        self._uppers = [b.up for b in self.buckets]
        self.splits += 1

    def _replace(self, bucket: RequestBucket) -> None:
        self.buckets = [bucket]
        self._uppers = [bucket.up]

    def expected_waste(self) -> float:
        """Eq. 3 over the queued effective lengths and the current boundaries."""
        return expected_waste_of_buckets(
            [len(b) for b in self.buckets], [b.total_len for b in self.buckets], self._uppers
        )
