"""When a stage was busy: per-microbatch intervals and totals (bookkeeping, no torch)."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

MAX_SPANS = 4096


@dataclass(frozen=True)
class StageSpan:
    """Stage `stage` ran microbatch `microbatch` from `start` to `end` (wall clock, s)."""

    stage: int
    microbatch: int
    start: float
    end: float


class StageClock:
    """Busy time of one stage: the recent spans (for overlap checks and hand-off latency)
    and the running total (for the bubble fraction)."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.busy_s = 0.0
        self.count = 0
        self._spans: deque[StageSpan] = deque(maxlen=MAX_SPANS)
        self._lock = threading.Lock()

    def record(self, microbatch: int, start: float, end: float) -> None:
        with self._lock:
            self._spans.append(StageSpan(self.stage, microbatch, start, end))
            self.busy_s += end - start
            self.count += 1

    def snapshot(self, spans: bool = False) -> tuple[float, int, list[StageSpan]]:
        """(busy seconds, microbatches run, the recent spans if asked for)."""
        with self._lock:
            return self.busy_s, self.count, list(self._spans) if spans else []
