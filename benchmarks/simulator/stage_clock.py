"""One worker's pipeline stages in simulated time: when the first stage is free for the next
microbatch, how many are in flight, and how much of the stages' time went idle (bubbles)."""

from __future__ import annotations

from benchmarks.simulator.event_loop import EventLoop


class StageClock:
    """`stages` stages fed one microbatch after another: a microbatch occupies each stage for
    `stage_s` in turn, so the first stage is free again `stage_s` after it started and at
    most `stages` are in flight. Bubbles are stage-seconds without work while the group has
    a microbatch in flight (hops between stages and an unfilled pipeline)."""

    def __init__(self, stages: int, loop: EventLoop) -> None:
        self.stages = stages
        self.loop = loop
        self.first_free_at = 0.0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.stage_busy_s = 0.0  # stage-seconds computed
        self._active_s = 0.0  # seconds with a microbatch in flight
        self._active_since = 0.0

    @property
    def full(self) -> bool:
        return self.in_flight >= self.stages or self.loop.now < self.first_free_at

    def start(self, stage_s: float) -> None:
        if self.in_flight == 0:
            self._active_since = self.loop.now
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.first_free_at = self.loop.now + stage_s
        self.stage_busy_s += stage_s * self.stages

    def finish(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._active_s += self.loop.now - self._active_since

    @property
    def active_s(self) -> float:
        running = self.loop.now - self._active_since if self.in_flight else 0.0
        return self._active_s + running

    @property
    def bubble_fraction(self) -> float:
        active = self.active_s
        if active <= 0:
            return 0.0
        return max(0.0, 1.0 - self.stage_busy_s / (self.stages * active))  # 0, not -1e-16
