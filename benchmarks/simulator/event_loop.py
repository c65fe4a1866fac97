"""The discrete-event core: a clock and a heap of timed callbacks."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any


class EventLoop:
    """Callbacks run in time order; equal times run in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events_run = 0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, time: float, callback: Callable[..., Any], *args: Any) -> None:
        if not math.isfinite(time) or time < self.now:
            raise ValueError(f"cannot schedule at {time!r}: the clock is at {self.now}")
        heapq.heappush(self._heap, (time, next(self._seq), callback, args))

    def after(self, delay: float, callback: Callable[..., Any], *args: Any) -> None:
        if not delay >= 0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay!r}")
        self.at(self.now + delay, callback, *args)

    def run(self, until: float = math.inf) -> float:
        """Run events up to and including `until`; returns the clock."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            time, _, callback, args = heapq.heappop(heap)
            self.now = time
            self.events_run += 1
            callback(*args)
        if heap and until != math.inf:
            self.now = until
        return self.now
