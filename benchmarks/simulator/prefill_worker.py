"""A simulated prefill accelerator (or pipeline-stage group): runs a batch and streams its K/V
out over its own link, one transfer after another, while it computes the next batch. With
pp stages it takes the next batch as soon as its first stage hands this one on.

With a prefix cache (`num_blocks`), the real BlockManager keeps what the worker computed:
a batch's prompts find their cached leading blocks (`lookup`) and compute only the rest.
A batch `submit`ted while another waits for the first stage queues behind it (the
service's prefill workers take `max_batches_per_prefill` batches at once)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from benchmarks.simulator.cost_model import CostModel
from benchmarks.simulator.event_loop import EventLoop
from benchmarks.simulator.hardware import LinkSpec
from benchmarks.simulator.stage_clock import StageClock
from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.sequence import Sequence


class PrefillWorker:
    def __init__(
        self,
        index: int,
        loop: EventLoop,
        cost: CostModel,
        link: LinkSpec,
        num_blocks: int | None = None,
        block_size: int = 16,
        layerwise: bool = False,
    ) -> None:
        """`layerwise`: each layer's K/V leaves as soon as the layer is computed (the link
        still moves one chunk after another), instead of all of it after the prefill."""
        self.index = index
        self.loop = loop
        self.cost = cost
        self.link = link
        self.layerwise = layerwise
        self.stages = StageClock(cost.pp, loop)
        self.link_free_at = 0.0
        self._on_free: Callable[[], None] | None = None  # waits for a batch to finish
        self.cache = None if num_blocks is None else BlockManager(num_blocks, block_size, True)
        self.assigned = 0  # batches submitted whose first stage has not finished
        self.pending_blocks = 0  # their prompts' blocks, as the service's handle counts them
        self._ready = True  # no batch is waiting for the first stage
        self._backlog: deque[tuple[tuple[Any, ...], dict[str, Any]]] = deque()

    @property
    def free_blocks(self) -> int:
        """The pool's blocks less those of the batches it holds (cached ones count free)."""
        free = 0 if self.cache is None else self.cache.num_free_blocks
        return free - self.pending_blocks

    def submit(self, *args: Any, **kwargs: Any) -> None:
        """`run` the batch now, or once the batches submitted before it have left the first
        stage (`run`'s arguments)."""
        if self._ready:
            self._ready = False
            self.run(*args, **kwargs)
        else:
            self._backlog.append((args, kwargs))

    def lookup(self, prompts: list[list[int]]) -> list[int]:
        """Tokens of each prompt the cache holds; then every prompt's blocks are cached as
        computed. All are looked up first: prompts of one batch do not hit each other. A
        prompt the pool has no room for computes whole and is not cached."""
        if self.cache is None:
            return [0] * len(prompts)
        bm = self.cache
        seqs = [Sequence(tokens) for tokens in prompts]
        held = []
        for seq in seqs:
            if bm.can_allocate(seq):
                bm.allocate(seq)
                held.append(seq)
        for seq in held:
            seq.num_computed_tokens = len(seq)
            bm.cache_computed(seq)
            bm.free(seq)
        return [seq.num_cached_tokens or 0 for seq in seqs]

    @property
    def busy_s(self) -> float:
        return self.stages.stage_busy_s / self.cost.pp

    def run(
        self,
        prompt_lens: list[int],
        pad_to: tuple[int, ...] | None,
        on_free: Callable[[], None],
        on_prefilled: Callable[[], None],
        on_landed: Callable[[], None],
        shipped: int | None = None,
        context_lens: list[int] | None = None,
    ) -> float:
        """Prefill the batch (`prompt_lens` tokens to compute per prompt, over
        `context_lens` cached ones); `on_free` once the worker can take another batch (its
        first stage is free), `on_prefilled` when its first tokens exist, `on_landed` when
        the K/V of its `shipped` tokens (default: all computed) has reached the decode worker
        (never, with none to ship). Returns the prefill's seconds (first stage to last)."""
        work = self.cost.prefill_work(prompt_lens, pad_to, context_lens)
        stage, latency = self.cost.time(work), self.cost.pipeline_latency(work)
        self.stages.start(stage)
        self.loop.after(stage, self._first_stage_free, lambda: self._next(on_free))
        tokens = sum(prompt_lens) if shipped is None else shipped
        self.loop.after(latency, self._prefilled, tokens, latency, on_prefilled, on_landed)
        return latency

    def _landing(self, tokens: int, latency: float) -> float:
        """When the K/V of `tokens` is on the decode side: after the prefill, the whole of it
        over the link; layer-wise, layer i's chunk leaves once layer i is computed (the
        layers take `latency` evenly) and once the link has moved the chunks before it."""
        now, whole = self.loop.now, self.cost.transfer_time(tokens, self.link)
        if not self.layerwise:
            return max(now, self.link_free_at) + whole
        layers = self.cost.model.num_layers
        start, chunk = now - latency, whole / layers
        end = self.link_free_at
        for layer in range(layers):
            end = max(end, start + (layer + 1) * latency / layers) + chunk
        return end

    def _next(self, on_free: Callable[[], None]) -> None:
        """A batch left the first stage: the next submitted one starts; `on_free` tells."""
        if self._backlog:
            args, kwargs = self._backlog.popleft()
            self.run(*args, **kwargs)
        else:
            self._ready = True
        on_free()

    def _first_stage_free(self, on_free: Callable[[], None]) -> None:
        """Take the next batch now, unless pp batches are in flight: then once one ends."""
        if self.stages.in_flight < self.cost.pp:
            on_free()
        else:
            self._on_free = on_free

    def _prefilled(
        self,
        tokens: int,
        latency: float,
        on_prefilled: Callable[[], None],
        on_landed: Callable[[], None],
    ) -> None:
        if tokens:
            self.link_free_at = self._landing(tokens, latency)
            self.loop.at(self.link_free_at, on_landed)
        self.stages.finish()
        on_prefilled()
        if self._on_free is not None:
            on_free, self._on_free = self._on_free, None
            on_free()
