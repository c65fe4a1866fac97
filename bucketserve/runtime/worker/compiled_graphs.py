"""Graphs mode: one static-shape compiled graph per shape bucket, compiled once, replayed."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bucketserve.runtime.cpu import kernels
from bucketserve.runtime.worker.device import Device, GraphFn
from bucketserve.runtime.worker.graph_regions import (
    decode_layer_region,
    head_region,
    layer_region,
    norm_region,
    tail_region,
    unified_layer_region,
)
from bucketserve.runtime.worker.kv_cache import KVCache
from bucketserve.runtime.worker.step_inputs import Shape, UnifiedShape

logger = logging.getLogger(__name__)
LayerHook = Callable[[int], None]


@dataclass
class GraphStats:
    """Compile seconds per warmed shape; misses (shapes compiled while serving) and their
    compile seconds, each miss counted once; `kv_export`: when layer-wise KV leaves a step."""

    compile_s: dict[Shape | UnifiedShape, float] = field(default_factory=dict)
    misses: int = 0
    miss_compile_s: float = 0.0
    kv_export: str = "per_layer"
    prompt_tokens: int = 0  # real tokens of prefill parts (chunks longer than one token)
    prompt_padded_tokens: int = 0  # ... and what their shapes ran, padding included

    @property
    def prompt_padding_share(self) -> float:
        padded = self.prompt_padded_tokens
        return 1.0 - self.prompt_tokens / padded if padded else 0.0

    @property
    def total_compile_s(self) -> float:
        return sum(self.compile_s.values()) + self.miss_compile_s


class CompiledGraphs:
    """The padded step as static-shape regions the device compiles (`Device.compile`): the
    head (embeddings, rope rows, mask), one decoder layer, and the tail (norm, logits), as
    `graph_regions` defines them.
    The layer region is compiled once per shape and reused by all layers, whose weights
    and K/V tensors are its inputs, so compiles grow with the buckets, not the depth.
    Where the device captures a whole step (CUDA graphs, HPU graphs in lazy mode) the
    regions run inside one captured graph per shape and layer-wise KV export comes after
    it; elsewhere each layer's KV is reported as soon as its region returns.
    A unified shape `(tokens, shared blocks, unique blocks, is_causal)` runs the head, the
    unified layer and the final norm: its graph returns every token's hidden state, and the
    caller takes the LM head of the rows it samples."""

    def __init__(
        self, model: torch.nn.Module, kv_cache: KVCache, device: Device, compiled: bool = True
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.compiled = compiled  # False: the same steps run eagerly (padded eager decode)
        compile = device.compile if compiled else (lambda fn: fn)
        self._head = compile(head_region)
        # CPU attention: the kernels eager steps run, custom ops inside the graph
        c, kernel = model.config, kernels.for_tensors(kv_cache.dtype, kv_cache.device)
        self.attention_kernels = kernel is not None and kernel.supports(
            c.head_dim, model.num_queries_per_kv, kv_cache.block_size
        )
        self._layer = compile(layer_region)
        self._decode_layer = compile(decode_layer_region)
        self._tail = compile(tail_region)
        self._unified_layer = compile(unified_layer_region)
        self._norm = compile(norm_region)
        self._steps: dict[Shape | UnifiedShape, GraphFn] = {}
        export = "after_graph" if device.captures_whole_step else "per_layer"
        self.stats = GraphStats(kv_export=export)

    def __contains__(self, shape: Shape | UnifiedShape) -> bool:
        return shape in self._steps

    @property
    def shapes(self) -> list[Shape | UnifiedShape]:
        return list(self._steps)

    @property
    def unified(self) -> bool:
        """Whether unified shapes were compiled: then every step runs as one."""
        return any(len(s) == 4 for s in self._steps)

    def fit(self, need: Shape | UnifiedShape) -> Shape | UnifiedShape | None:
        """The smallest compiled shape (padded volume) of `need`'s kind (decode: query 1)
        that holds it in every dimension; a unified need: the first in order that holds
        it, causal if it is (one without prompt chunks takes a causal one only when no
        other holds it)."""
        if len(need) == 4:
            for causal in (0, 1) if need[3] == 0 else (1,):
                fits = [
                    s
                    for s in self._steps
                    if len(s) == 4
                    and s[3] == causal
                    and all(h >= w for h, w in zip(s[:3], need[:3], strict=True))
                ]
                if fits:
                    return min(fits)
            return None
        fits = [
            s
            for s in self._steps
            if len(s) == 3
            and (s[1] == 1) == (need[1] == 1)
            and all(h >= w for h, w in zip(s, need, strict=True))
        ]
        return min(fits, key=lambda s: (s[0] * s[1] * (s[2] + 1), s), default=None)

    def warm(self, shape: Shape | UnifiedShape, args: tuple[torch.Tensor, ...]) -> float:
        """Compile (and capture) `shape`'s graph on dummy `args`; returns the seconds."""
        if shape in self._steps:
            return 0.0
        start = time.perf_counter()
        self._steps[shape] = self.device.graph(self._step(shape), args)
        if not self.device.captures_whole_step:
            self._step(shape)(*args)  # the first call compiles
        self.device.synchronize()
        seconds = time.perf_counter() - start
        self.stats.compile_s[shape] = seconds
        return seconds

    def run(
        self,
        shape: Shape | UnifiedShape,
        args: tuple[torch.Tensor, ...],
        on_layer: LayerHook | None = None,
    ) -> torch.Tensor:
        """Replay `shape`'s graph (logits; a unified shape: hidden states); a shape not
        warmed compiles here, a counted miss."""
        if not self.compiled:
            return self._step(shape)(*args, on_layer=on_layer)
        if shape not in self._steps:
            start = time.perf_counter()
            self._steps[shape] = self.device.graph(self._step(shape), args)
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
                logits = self._step(shape)(*args, on_layer=on_layer)
                self.stats.miss_compile_s += seconds + time.perf_counter() - start
                return logits
        if self.device.captures_whole_step:
            logits = self._steps[shape](*args)
            for layer in range(self.kv_cache.num_layers if on_layer else 0):
                on_layer(layer)  # a replayed graph cannot stop between layers
            return logits
        return self._step(shape)(*args, on_layer=on_layer)

    def _step(self, shape: Shape | UnifiedShape) -> Callable[..., torch.Tensor]:
        """Decode shapes `(batch, 1, blocks)` read a flat block list; unified shapes their
        flat tokens and context blocks; the rest rectangles."""
        if len(shape) == 4:
            return self.step_causal if shape[3] else self.step_unified
        return self.step_flat if shape[1] == 1 else self.step

    def step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        token_order: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        rows: torch.Tensor,
        on_layer: LayerHook | None = None,
    ) -> torch.Tensor:
        num_keys = block_tables.shape[1] * self.kv_cache.block_size
        masked = None if self.attention_kernels else query_positions  # the kernel needs none
        x, cos_sin, mask = self._head(self.model, input_ids, positions, masked, num_keys)
        index = (
            slots, block_tables, mask, token_order, query_start_loc, context_lens, query_positions
        )  # fmt: skip
        for i, layer in enumerate(self.model.model.layers):
            k, v = self.kv_cache.layer(i)
            x = self._layer(layer, x, cos_sin, k, v, *index, self.attention_kernels)
            if on_layer is not None:
                on_layer(i)
        return self._tail(self.model, x, rows)

    def step_flat(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_list: torch.Tensor,
        block_rows: torch.Tensor,
        block_valid: torch.Tensor,
        block_starts: torch.Tensor,
        context_lens: torch.Tensor,
        rows: torch.Tensor,
        on_layer: LayerHook | None = None,
    ) -> torch.Tensor:
        x, cos_sin, _ = self._head(self.model, input_ids, positions)
        index = (slots, block_list, block_rows, block_valid, block_starts, context_lens)
        for i, layer in enumerate(self.model.model.layers):
            k, v = self.kv_cache.layer(i)
            x = self._decode_layer(layer, x, cos_sin, k, v, *index, self.attention_kernels)
            if on_layer is not None:
                on_layer(i)
        return self._tail(self.model, x, rows)

    def step_unified(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        token_rows: torch.Tensor,
        context_ends: torch.Tensor,
        shared_blocks: torch.Tensor,
        shared_starts: torch.Tensor,
        unique_blocks: torch.Tensor,
        unique_owners: torch.Tensor,
        unique_starts: torch.Tensor,
        on_layer: LayerHook | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """A unified step: every token's final hidden state `[T, hidden]`."""
        x, cos_sin, _ = self._head(self.model, input_ids, positions)
        index = (
            positions, slots, token_rows, context_ends, shared_blocks, shared_starts,
            unique_blocks, unique_owners, unique_starts,
        )  # fmt: skip
        for i, layer in enumerate(self.model.model.layers):
            k, v = self.kv_cache.layer(i)
            x = self._unified_layer(layer, x, cos_sin, k, v, *index, causal)
            if on_layer is not None:
                on_layer(i)
        return self._norm(self.model, x)

    def step_causal(self, *args: torch.Tensor, on_layer: LayerHook | None = None) -> torch.Tensor:
        """`step_unified` of a step with prompt chunks (a causal bucket)."""
        return self.step_unified(*args, on_layer=on_layer, causal=True)
