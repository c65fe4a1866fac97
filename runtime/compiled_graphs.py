"""Graphs mode: one static-shape compiled graph per shape bucket, compiled once, replayed."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from runtime.device import Device, GraphFn
from runtime.kv_cache import KVCache
from runtime.models.llama import graph_layer
from runtime.step_inputs import Shape

logger = logging.getLogger(__name__)
LayerHook = Callable[[int], None]


@dataclass
class GraphStats:
    """Compile seconds per warmed shape; misses (shapes compiled while serving) and their
    compile seconds, each miss counted once; `kv_export`: when layer-wise KV leaves a step."""

    compile_s: dict[Shape, float] = field(default_factory=dict)
    misses: int = 0
    miss_compile_s: float = 0.0
    kv_export: str = "per_layer"

    @property
    def total_compile_s(self) -> float:
        return sum(self.compile_s.values()) + self.miss_compile_s


class CompiledGraphs:
    """The padded step as static-shape regions the device compiles (`Device.compile`): the
    head (embeddings, rope rows, mask), one decoder layer, and the tail (norm, logits).
    The layer region is compiled once per shape and reused by all layers, whose weights
    and K/V tensors are its inputs, so compiles grow with the buckets, not the depth.
    Where the device captures a whole step (CUDA graphs, HPU graphs in lazy mode) the
    regions run inside one captured graph per shape and layer-wise KV export comes after
    it; elsewhere each layer's KV is reported as soon as its region returns."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: Device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self._head = device.compile(model.graph_head)
        self._layer = device.compile(graph_layer)
        self._tail = device.compile(model.graph_tail)
        self._steps: dict[Shape, GraphFn] = {}
        export = "after_graph" if device.captures_whole_step else "per_layer"
        self.stats = GraphStats(kv_export=export)

    def __contains__(self, shape: Shape) -> bool:
        return shape in self._steps

    @property
    def shapes(self) -> list[Shape]:
        return list(self._steps)

    def fit(self, need: Shape) -> Shape | None:
        """The smallest compiled shape (padded volume) that holds `need` in every dimension."""
        fits = [s for s in self._steps if all(h >= w for h, w in zip(s, need, strict=True))]
        return min(fits, key=lambda s: (s[0] * s[1] * (s[2] + 1), s), default=None)

    def warm(self, shape: Shape, args: tuple[torch.Tensor, ...]) -> float:
        """Compile (and capture) `shape`'s graph on dummy `args`; returns the seconds."""
        if shape in self._steps:
            return 0.0
        start = time.perf_counter()
        self._steps[shape] = self.device.graph(self.step, args)
        if not self.device.captures_whole_step:
            self.step(*args)  # the first call compiles
        self.device.synchronize()
        seconds = time.perf_counter() - start
        self.stats.compile_s[shape] = seconds
        return seconds

    def run(
        self, shape: Shape, args: tuple[torch.Tensor, ...], on_layer: LayerHook | None = None
    ) -> torch.Tensor:
        """Replay `shape`'s graph; a shape not warmed compiles here, a counted miss."""
        if shape not in self._steps:
            start = time.perf_counter()
            self._steps[shape] = self.device.graph(self.step, args)
            seconds = time.perf_counter() - start
            self.stats.misses += 1
            logger.warning(
                "step shape %s has no warmed graph: compiling it while serving (miss %d)",
                shape,
                self.stats.misses,
            )
            if self.device.captures_whole_step:
                self.stats.miss_compile_s += seconds
            else:
                start = time.perf_counter()
                logits = self.step(*args, on_layer=on_layer)
                self.stats.miss_compile_s += seconds + time.perf_counter() - start
                return logits
        if self.device.captures_whole_step:
            logits = self._steps[shape](*args)
            for layer in range(self.kv_cache.num_layers if on_layer else 0):
                on_layer(layer)  # a replayed graph cannot stop between layers
            return logits
        return self.step(*args, on_layer=on_layer)

    def step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        rows: torch.Tensor,
        on_layer: LayerHook | None = None,
    ) -> torch.Tensor:
        num_keys = block_tables.shape[1] * self.kv_cache.block_size
        x, cos_sin, mask = self._head(input_ids, positions, query_positions, num_keys)
        for i, layer in enumerate(self.model.model.layers):
            k, v = self.kv_cache.layer(i)
            x = self._layer(layer, x, cos_sin, k, v, slots, block_tables, mask)
            if on_layer is not None:
                on_layer(i)
        return self._tail(x, rows)
