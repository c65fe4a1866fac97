"""When and how long the SDK waits before trying an UNAVAILABLE call again."""

from __future__ import annotations

import random
from dataclasses import dataclass

from bucketserve.gateway.errors import BucketServeError, UnavailableError
from bucketserve.utils.checks import check_int, check_number


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter. Only UNAVAILABLE is retried (nothing was admitted),
    and a stream only before its first message, so no token is ever delivered twice."""

    max_attempts: int = 4  # 1: never retry
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2  # each wait is scaled by a random factor in [1 - jitter, 1 + jitter]

    def __post_init__(self) -> None:
        check_int("RetryPolicy.max_attempts", self.max_attempts, 1)
        check_number("RetryPolicy.initial_backoff_s", self.initial_backoff_s, 0.0)
        check_number("RetryPolicy.max_backoff_s", self.max_backoff_s, self.initial_backoff_s)
        check_number("RetryPolicy.multiplier", self.multiplier, 1.0)
        check_number("RetryPolicy.jitter", self.jitter, 0.0, 1.0)

    def should_retry(self, error: BucketServeError, attempt: int) -> bool:
        """`attempt` counts from 0: the call that just failed."""
        return isinstance(error, UnavailableError) and attempt + 1 < self.max_attempts

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt`."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**attempt)
        return base * random.uniform(1.0 - self.jitter, 1.0 + self.jitter)
