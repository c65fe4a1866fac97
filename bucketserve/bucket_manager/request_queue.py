"""One tenant's requests inside one request bucket, kept sorted by the tenant's order key."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from bucketserve.bucket_manager.policy import OrderKey
from bucketserve.bucket_manager.request import BucketRequest


class RequestQueue:
    def __init__(self) -> None:
        self._keys: list[OrderKey] = []
        self._requests: dict[OrderKey, BucketRequest] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[tuple[OrderKey, BucketRequest]]:
        return ((key, self._requests[key]) for key in self._keys)

    def head(self) -> OrderKey | None:
        return self._keys[0] if self._keys else None

    def push(self, key: OrderKey, request: BucketRequest) -> None:
        bisect.insort(self._keys, key)
        self._requests[key] = request

    def pop(self, key: OrderKey) -> BucketRequest:
        index = bisect.bisect_left(self._keys, key)
        del self._keys[index]
        return self._requests.pop(key)

    def partition(
        self, goes_left: Callable[[BucketRequest], bool]
    ) -> tuple[RequestQueue, RequestQueue]:
        """Stable split, so both halves stay sorted."""
        left, right = RequestQueue(), RequestQueue()
        for key in self._keys:
            request = self._requests[key]
            side = left if goes_left(request) else right
            side._keys.append(key)
            side._requests[key] = request
        return left, right

    @staticmethod
    def merge(queues: list[RequestQueue]) -> RequestQueue:
        merged = RequestQueue()
        for queue in queues:
            merged._requests.update(queue._requests)
        merged._keys = sorted(merged._requests)
        return merged
