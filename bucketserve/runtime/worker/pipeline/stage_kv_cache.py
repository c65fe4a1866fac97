"""The paged KV pool of a stage group as one pool: layer i lives on the stage holding it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bucketserve.runtime.worker.pipeline.stage import Stage


class StageKVCache:
    """What workers read of a KVCache (its format, and layer-wise export / import for the
    P→D handoff), routed by layer: layer i is exported from, and imported into, the stage
    that holds it, so prefill stage i hands its layers to decode stage i."""

    def __init__(
        self,
        stages: list[Stage],
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any,
    ) -> None:
        self.stages = stages
        self.num_layers = stages[-1].spec.stop
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self._owner = {layer: s for s in stages for layer in s.spec.layers}

    @property
    def null_block(self) -> int:
        return self.num_blocks

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    def stage_of(self, layer: int) -> Stage:
        if layer not in self._owner:
            raise ValueError(f"layer {layer} out of range; the pool has {self.num_layers} layers")
        return self._owner[layer]

    def export_blocks(self, layer: int, block_ids: Sequence[int]) -> Any:
        return self.stage_of(layer).export_blocks(layer, list(block_ids))

    def import_blocks(self, layer: int, block_ids: Sequence[int], data: Any) -> None:
        self.stage_of(layer).import_blocks(layer, list(block_ids), data)
