"""Poisson arrivals and the loopback guard."""

from __future__ import annotations

import numpy as np
import pytest

from bucketserve.bench.arrivals import PoissonArrivals
from bucketserve.bench.config import BenchConfig, check_loopback, host_of


def test_poisson_gaps_have_the_rate_mean_and_exponential_spread() -> None:
    times = PoissonArrivals(seed=7).times(rate=4.0, n=4001)
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() == pytest.approx(0.25, rel=0.08)  # exponential: std = mean
    assert np.mean(gaps < 0.25) == pytest.approx(1 - np.exp(-1), abs=0.03)


def test_same_seed_same_pattern_scaled_by_rate() -> None:
    slow = PoissonArrivals(3).times(1.0, 50)
    fast = PoissonArrivals(3).times(2.0, 50)
    assert fast == pytest.approx([t / 2 for t in slow])
    assert PoissonArrivals(4).times(1.0, 50) != slow
    assert PoissonArrivals(3).times(float("inf"), 3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate must be > 0"):
        PoissonArrivals(3).times(0.0, 5)


def test_only_loopback_targets_unless_allowed() -> None:
    for ok in ("127.0.0.1:50051", "localhost:50051", "[::1]:50051", "http://127.0.0.1:8000/v1"):
        check_loopback(ok)
    assert host_of("[::1]:50051") == "::1"
    assert host_of("http://localhost:8000/metrics") == "localhost"
    with pytest.raises(ValueError, match="--allow-remote"):
        check_loopback("10.1.2.3:50051")
    with pytest.raises(ValueError, match="--allow-remote"):
        BenchConfig(target="192.0.2.1:50051")
    BenchConfig(target="192.0.2.1:50051", allow_remote=True)
    with pytest.raises(ValueError, match="--model NAME"):
        BenchConfig(backend="openai")
    with pytest.raises(ValueError, match="rates must be > 0"):
        BenchConfig(rates=[1.0, -2.0])
