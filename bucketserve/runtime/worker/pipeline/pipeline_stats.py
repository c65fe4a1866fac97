"""A stage group's pipeline counters (bookkeeping, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bucketserve.runtime.worker.pipeline.stage_clock import StageSpan


@dataclass
class PipelineStats:
    """`bubble_fraction`: the share of stage time spent idle while the group had work,
    `1 - sum(stage busy) / (num_stages * active_s)`, where `active_s` is the time at least
    one microbatch was in flight. `handoff_s`: summed waits between one stage finishing a
    microbatch and the next stage starting it although it was free (moving hidden states
    and waking up), over `microbatches` microbatches."""

    num_stages: int = 1
    in_flight: int = 0
    microbatches: int = 0
    active_s: float = 0.0
    busy_s: list[float] = field(default_factory=list)
    handoff_s: float = 0.0
    spans: list[StageSpan] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        if self.active_s <= 0:
            return 0.0
        used = sum(self.busy_s) / (self.num_stages * self.active_s)
        return min(1.0, max(0.0, 1.0 - used))

    @property
    def handoff_s_per_step(self) -> float:
        """Per microbatch among the recent spans the hand-off time was measured over."""
        measured = len({s.microbatch for s in self.spans})
        return self.handoff_s / measured if measured else 0.0


def handoff_seconds(spans: list[StageSpan], num_stages: int) -> float:
    """For each microbatch and stage s > 0: how long after stage s - 1 finished it stage s
    started it, not counting time stage s was still busy with an earlier microbatch."""
    by_stage: dict[int, dict[int, StageSpan]] = {}
    for span in spans:
        by_stage.setdefault(span.stage, {})[span.microbatch] = span
    total = 0.0
    for s in range(1, num_stages):
        mine = sorted(by_stage.get(s, {}).values(), key=lambda x: x.start)
        previous_end = 0.0
        for span in mine:
            before = by_stage.get(s - 1, {}).get(span.microbatch)
            if before is not None:
                total += max(0.0, span.start - max(before.end, previous_end))
            previous_end = span.end
    return total
