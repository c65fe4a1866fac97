"""Token-length distributions: a clipped log-normal given by its mean, or a fixed length."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthDistribution:
    """Log-normal with mean `mean` (before clipping) and log-space spread `sigma`, clipped to
    `[low, high]`; `sigma == 0` is the fixed length `mean`."""

    mean: float
    sigma: float
    low: int
    high: int

    def __post_init__(self) -> None:
        if not self.mean > 0 or self.sigma < 0:
            raise ValueError(f"length mean must be > 0 and sigma >= 0, got {self.mean}, "
                             f"{self.sigma}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"length bounds must satisfy 1 <= low <= high, got "
                             f"[{self.low}, {self.high}]; raise the model length or lower low")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.sigma == 0:
            values = np.full(n, self.mean)
        else:
            mu = math.log(self.mean) - self.sigma**2 / 2
            values = rng.lognormal(mu, self.sigma, n)
        return [int(v) for v in np.clip(np.rint(values), self.low, self.high)]

    def capped(self, high: int) -> LengthDistribution:
        """The same shape truncated to at most `high` tokens."""
        high = max(1, high)
        return LengthDistribution(self.mean, self.sigma, min(self.low, high), min(self.high, high))


# Stanford Alpaca: instruction + input, mean ~83 tokens, a short right tail.
ALPACA = LengthDistribution(mean=83.0, sigma=0.6, low=8, high=512)
# LongBench: mean ~6.7k words of context, long-tailed; truncated to the model's length.
LONGBENCH = LengthDistribution(mean=8000.0, sigma=0.8, low=512, high=32768)
