"""A simulated prefill accelerator: runs one batch at a time and streams its K/V out over
its own link, one transfer after another, while it computes the next batch."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.simulator.cost_model import CostModel
from benchmarks.simulator.event_loop import EventLoop
from benchmarks.simulator.hardware import LinkSpec


class PrefillWorker:
    def __init__(self, index: int, loop: EventLoop, cost: CostModel, link: LinkSpec) -> None:
        self.index = index
        self.loop = loop
        self.cost = cost
        self.link = link
        self.busy = False
        self.busy_s = 0.0
        self.link_free_at = 0.0

    def run(
        self,
        prompt_lens: list[int],
        pad_to: tuple[int, int] | None,
        on_prefilled: Callable[[], None],
        on_landed: Callable[[], None],
    ) -> float:
        """Prefill the batch; `on_prefilled` when its first tokens exist, `on_landed` when its
        K/V has reached the decode worker. Returns the prefill's seconds."""
        seconds = self.cost.prefill_time(prompt_lens, pad_to)
        self.busy = True
        self.busy_s += seconds
        self.loop.after(seconds, self._prefilled, sum(prompt_lens), on_prefilled, on_landed)
        return seconds

    def _prefilled(
        self, tokens: int, on_prefilled: Callable[[], None], on_landed: Callable[[], None]
    ) -> None:
        start = max(self.loop.now, self.link_free_at)
        self.link_free_at = start + self.cost.transfer_time(tokens, self.link)
        self.loop.at(self.link_free_at, on_landed)
        self.busy = False
        on_prefilled()
