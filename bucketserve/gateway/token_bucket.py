"""A token bucket: `rate` tokens per second refill a bucket of `capacity` (torch-free)."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    def __init__(
        self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0 or capacity <= 0:
            raise ValueError(f"rate and capacity must be positive, got {rate!r}, {capacity!r}")
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._level = capacity
        self._stamp = clock()

    @property
    def level(self) -> float:
        self._refill()
        return self._level

    def take(self, amount: float) -> float:
        """Take `amount` tokens and return 0.0, or take nothing and return the seconds until
        `amount` will be there. `amount` must not exceed the capacity."""
        if amount > self.capacity:
            raise ValueError(f"{amount} tokens never fit a bucket of {self.capacity}")
        self._refill()
        if amount <= self._level:
            self._level -= amount
            return 0.0
        return (amount - self._level) / self.rate

    def give_back(self, amount: float) -> None:
        self._refill()
        self._level = min(self.capacity, self._level + amount)

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._stamp) * self.rate)
        self._stamp = now
