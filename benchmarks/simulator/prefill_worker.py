"""A simulated prefill accelerator (or pipeline-stage group): runs a batch and streams its K/V
out over its own link, one transfer after another, while it computes the next batch. With
pp stages it takes the next batch as soon as its first stage hands this one on."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.simulator.cost_model import CostModel
from benchmarks.simulator.event_loop import EventLoop
from benchmarks.simulator.hardware import LinkSpec
from benchmarks.simulator.stage_clock import StageClock


class PrefillWorker:
    def __init__(self, index: int, loop: EventLoop, cost: CostModel, link: LinkSpec) -> None:
        self.index = index
        self.loop = loop
        self.cost = cost
        self.link = link
        self.stages = StageClock(cost.pp, loop)
        self.link_free_at = 0.0
        self._on_free: Callable[[], None] | None = None  # waits for a batch to finish

    @property
    def busy_s(self) -> float:
        return self.stages.stage_busy_s / self.cost.pp

    def run(
        self,
        prompt_lens: list[int],
        pad_to: tuple[int, int] | None,
        on_free: Callable[[], None],
        on_prefilled: Callable[[], None],
        on_landed: Callable[[], None],
        shipped: int | None = None,
    ) -> float:
        """Prefill the batch; `on_free` once the worker can take another batch (its first
        stage is free), `on_prefilled` when its first tokens exist, `on_landed` when the K/V
        of its `shipped` tokens (default: all) has reached the decode worker (never, with
        none to ship). Returns the prefill's seconds (first stage to last)."""
        work = self.cost.prefill_work(prompt_lens, pad_to)
        stage, latency = self.cost.time(work), self.cost.pipeline_latency(work)
        self.stages.start(stage)
        self.loop.after(stage, self._first_stage_free, on_free)
        tokens = sum(prompt_lens) if shipped is None else shipped
        self.loop.after(latency, self._prefilled, tokens, on_prefilled, on_landed)
        return latency

    def _first_stage_free(self, on_free: Callable[[], None]) -> None:
        """Take the next batch now, unless pp batches are in flight: then once one ends."""
        if self.stages.in_flight < self.cost.pp:
            on_free()
        else:
            self._on_free = on_free

    def _prefilled(
        self, tokens: int, on_prefilled: Callable[[], None], on_landed: Callable[[], None]
    ) -> None:
        if tokens:
            start = max(self.loop.now, self.link_free_at)
            self.link_free_at = start + self.cost.transfer_time(tokens, self.link)
            self.loop.at(self.link_free_at, on_landed)
        self.stages.finish()
        on_prefilled()
        if self._on_free is not None:
            on_free, self._on_free = self._on_free, None
            on_free()
