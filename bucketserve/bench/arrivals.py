"""Open-loop arrival times."""

from __future__ import annotations

import numpy as np


class PoissonArrivals:
    """A Poisson process: exponential inter-arrival gaps of mean `1 / rate`.

    The unit-rate gaps are drawn once from the seed and divided by the rate, so a sweep offers
    every rate the same arrival pattern, compressed.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def times(self, rate: float, n: int) -> list[float]:
        """Send offsets in seconds from the start, the first at 0; `rate=inf`: all at once."""
        if not rate > 0:
            raise ValueError(f"request rate must be > 0 requests/s, got {rate!r}")
        if n < 0:
            raise ValueError(f"number of requests must be >= 0, got {n}")
        if rate == float("inf") or n == 0:
            return [0.0] * n
        gaps = np.random.default_rng(self.seed).exponential(1.0, n) / rate
        gaps[0] = 0.0
        return [float(t) for t in np.cumsum(gaps)]
