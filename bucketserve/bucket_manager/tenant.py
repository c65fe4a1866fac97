"""A tenant's live state: its order key, tokens served (fair share) and oldest request (aging)."""

from __future__ import annotations

import heapq
from collections.abc import Callable

from bucketserve.bucket_manager.config import TenantConfig
from bucketserve.bucket_manager.policy import OrderKey, Policy
from bucketserve.bucket_manager.request import BucketRequest


class Tenant:
    def __init__(self, config: TenantConfig) -> None:
        self.config = config
        self.policy = Policy(config.policy)
        self.served_tokens = 0.0
        self.queued = 0
        self.queued_tokens = 0  # prompt tokens its queued requests compute
        self._arrivals: list[tuple[float, int, BucketRequest]] = []  # lazy-deletion heap

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def share(self) -> float:
        """Tokens served (prompt and output) per unit of weight: equal weights get equal
        tokens."""
        return self.served_tokens / self.config.weight

    def rank(self) -> tuple[int, float, str]:
        """Across tenants: priority first, then the smallest fair share."""
        return self.config.priority, self.share, self.name

    def order_key(self, request: BucketRequest, seq: int) -> OrderKey:
        return self.policy.order_key(request, seq)

    def track(self, request: BucketRequest, seq: int) -> None:
        heapq.heappush(self._arrivals, (request.arrival_time, seq, request))

    def oldest(self, is_queued: Callable[[BucketRequest, int], bool]) -> BucketRequest | None:
        """The earliest-arriving request still queued; entries of served ones are dropped."""
        while self._arrivals:
            _, seq, request = self._arrivals[0]
            if is_queued(request, seq):
                return request
            heapq.heappop(self._arrivals)
        return None

    def is_aged(self, request: BucketRequest, now: float) -> bool:
        bound = self.config.max_wait_s
        return bound is not None and now - request.arrival_time >= bound
