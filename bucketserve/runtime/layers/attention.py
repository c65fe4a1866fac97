"""The attention call a decoder layer makes: `attend(q, k, v, scale)` writes the step's K/V
into the layer's paged cache and attends each query over its row's context. One factory
per step form: eager steps, by the step's metadata (`paged_attend`), and the static-shape
regions a graph compiler takes, from tensors alone: padded prompt rectangles
(`rect_attend`) and decode steps over their flat block list (`flat_attend`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from bucketserve.runtime.attention.metadata import AttentionMetadata
from bucketserve.runtime.attention.paged_attention import (
    attend_flat,
    attend_rect,
    paged_attention,
    write_kv,
    write_slots,
)
from bucketserve.runtime.cpu.graph_ops import paged_decode_flat, paged_prefill_rect

# (q [T, heads, dim], k, v [T, kv_heads, dim], scale) -> attention output [T, heads, dim]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class KVLayers(Protocol):
    """The paged KV pool as a model reads it, layer by layer."""

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer."""
        ...


def paged_attend(
    k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata
) -> Attend:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, metadata)
        return paged_attention(q, k, v, k_cache, v_cache, metadata, scale)

    return attend


def rect_attend(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    token_order: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    kernel: bool = False,
) -> Attend:
    """A padded rectangle: `attend_rect` under `mask`, or with `kernel` the CPU's varlen
    kernel as a custom op (`graph_ops.paged_prefill_rect`) over the rectangle's real
    tokens."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        write_slots(k, v, k_cache, v_cache, slots)
        if kernel:
            return paged_prefill_rect(
                q, k_cache, v_cache, block_tables, token_order, query_start_loc, context_lens,
                scale,
            )  # fmt: skip
        return attend_rect(q, k_cache, v_cache, block_tables, mask, scale)

    return attend


def flat_attend(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_list: torch.Tensor,
    block_rows: torch.Tensor,
    block_valid: torch.Tensor,
    block_starts: torch.Tensor,
    context_lens: torch.Tensor,
    kernel: bool = False,
) -> Attend:
    """A decode step over its flat block list: `attend_flat`, or with `kernel` the CPU
    kernel as a custom op (`graph_ops.paged_decode_flat`), which reads each row's blocks
    from `block_starts` and its `context_lens` instead of the masks."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        write_slots(k, v, k_cache, v_cache, slots)
        if kernel:
            return paged_decode_flat(
                q, k_cache, v_cache, block_list, block_starts, context_lens, scale
            )
        return attend_flat(q, k_cache, v_cache, block_list, block_rows, block_valid, scale)

    return attend
