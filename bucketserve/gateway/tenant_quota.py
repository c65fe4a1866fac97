"""A tenant's live admission state: requests in flight and its token bucket (torch-free)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from bucketserve.bucket_manager.config import TenantConfig
from bucketserve.gateway.errors import InvalidArgumentError, ResourceExhaustedError
from bucketserve.gateway.token_bucket import TokenBucket

CONCURRENCY_RETRY_AFTER_S = 1.0


class TenantQuota:
    def __init__(self, tenant: TenantConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.tenant = tenant
        self.running = 0
        self.bucket: TokenBucket | None = None
        if tenant.token_rate_limit is not None and tenant.burst is not None:
            self.bucket = TokenBucket(tenant.token_rate_limit, tenant.burst, clock)

    def acquire(self, tokens: int) -> None:
        """Admit one request costing `tokens` (prompt + max output), or raise and change
        nothing: ResourceExhaustedError when over quota now, InvalidArgumentError when it
        could never fit."""
        name, limit = self.tenant.name, self.tenant.max_concurrent_requests
        if limit is not None and self.running >= limit:
            raise ResourceExhaustedError(
                f"tenant {name!r} already has {self.running} requests running, its "
                f"max_concurrent_requests; retry after one finishes",
                CONCURRENCY_RETRY_AFTER_S,
            )
        if self.bucket is not None:
            if tokens > self.bucket.capacity:
                raise InvalidArgumentError(
                    f"the request needs {tokens} tokens (prompt + max_tokens) but tenant "
                    f"{name!r} may use at most {self.bucket.capacity:g} at once; lower "
                    "max_tokens or shorten the prompt"
                )
            wait = self.bucket.take(tokens)
            if wait > 0:
                raise ResourceExhaustedError(
                    f"tenant {name!r} is over its token rate limit of "
                    f"{self.tenant.token_rate_limit:g} tokens/s; retry after {wait:.2f}s",
                    math.ceil(wait * 100) / 100,
                )
        self.running += 1

    def release(self, unused_tokens: int = 0) -> None:
        """A request admitted by acquire() ended; `unused_tokens` of its cost go back."""
        self.running -= 1
        if self.bucket is not None and unused_tokens > 0:
            self.bucket.give_back(unused_tokens)
