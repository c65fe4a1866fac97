"""An exponential moving average: the running estimates that follow a machine's drift."""

from __future__ import annotations

ALPHA = 0.2  # the newest sample's weight


def moving_average(old: float | None, new: float, alpha: float = ALPHA) -> float:
    """`new` mixed into `old` with weight `alpha` (`new` itself when there is no `old`)."""
    return new if old is None else old + alpha * (new - old)
