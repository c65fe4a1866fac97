"""A request bucket: lengths to compute (`BucketRequest.effective_len`) in `[low, up)`, one
sorted queue per tenant."""

from __future__ import annotations

import bisect

from bucketserve.bucket_manager.policy import OrderKey
from bucketserve.bucket_manager.request import BucketRequest
from bucketserve.bucket_manager.request_queue import RequestQueue


class RequestBucket:
    def __init__(self, low: int, up: int) -> None:
        self.low = low
        self.up = up
        self.queues: dict[str, RequestQueue] = {}
        self._lengths: list[int] = []  # sorted effective lengths, for the split test
        self.total_len = 0

    def __len__(self) -> int:
        return len(self._lengths)

    def __repr__(self) -> str:
        return f"RequestBucket([{self.low}, {self.up}), n={len(self)})"

    @property
    def midpoint(self) -> int:
        return (self.low + self.up) // 2

    def count_below(self, length: int) -> int:
        return bisect.bisect_left(self._lengths, length)

    def queue_lengths(self) -> dict[str, int]:
        return {tenant: len(q) for tenant, q in self.queues.items() if len(q)}

    def push(self, key: OrderKey, request: BucketRequest) -> None:
        self.queues.setdefault(request.tenant, RequestQueue()).push(key, request)
        bisect.insort(self._lengths, request.effective_len)
        self.total_len += request.effective_len

    def pop(self, tenant: str, key: OrderKey) -> BucketRequest:
        request = self.queues[tenant].pop(key)
        del self._lengths[bisect.bisect_left(self._lengths, request.effective_len)]
        self.total_len -= request.effective_len
        return request

    def split(self, point: int) -> tuple[RequestBucket, RequestBucket]:
        """`[low, point)` and `[point, up)`, each request going to the half holding its length."""
        left, right = RequestBucket(self.low, point), RequestBucket(point, self.up)
        for tenant, queue in self.queues.items():
            left.queues[tenant], right.queues[tenant] = queue.partition(
                lambda r: r.effective_len < point
            )
        cut = self.count_below(point)
        left._lengths, right._lengths = self._lengths[:cut], self._lengths[cut:]
        left.total_len = sum(left._lengths)
        right.total_len = self.total_len - left.total_len
        return left, right

    @staticmethod
    def merge(buckets: list[RequestBucket]) -> RequestBucket:
        merged = RequestBucket(buckets[0].low, buckets[-1].up)
        tenants = {t for b in buckets for t in b.queues}
        for tenant in tenants:
            merged.queues[tenant] = RequestQueue.merge(
                [b.queues[tenant] for b in buckets if tenant in b.queues]
            )
        merged._lengths = sorted(length for b in buckets for length in b._lengths)
        merged.total_len = sum(b.total_len for b in buckets)
        return merged
