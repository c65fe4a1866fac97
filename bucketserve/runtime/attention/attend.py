"""The attention call a decoder layer makes: `attend(q, k, v, scale, sliding_window=None)`
writes the step's K/V into the layer's paged cache and attends each query over its row's
context, or with a sliding window w over its last w positions (the query's own included).
One factory per step form, each the K/V write (`writing`) before one attention of this
package: eager steps, by the step's metadata (`paged_attend`), and the static-shape regions
a graph compiler takes, from tensors alone: padded prompt rectangles (`rect_attend`), decode
steps over their flat block list (`flat_attend`) and unified steps (`unified_attend`). The
window is a layer's own python int: inside a graph it is a constant of the trace."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from bucketserve.runtime.attention.metadata import AttentionMetadata, rect_mask
from bucketserve.runtime.attention.paged_attention import (
    attend_flat,
    attend_rect,
    flat_window,
    paged_attention,
    write_kv,
    write_slots,
)
from bucketserve.runtime.attention.unified import attend_unified
from bucketserve.runtime.cpu.graph_ops import paged_decode_flat, paged_prefill_rect


class Attend(Protocol):
    """(q [T, heads, dim], k, v [T, kv_heads, dim], scale) -> output [T, heads, dim]; the
    query at position p sees keys 0..p, or p - w + 1..p with `sliding_window` w (None: the
    whole context; transformers' semantics)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor: ...


class KVLayers(Protocol):
    """The paged KV pool as a model reads it, layer by layer."""

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer."""
        ...


def writing(
    write: Callable[[torch.Tensor, torch.Tensor], None], attention: Attend
) -> Attend:
    """The Attend that writes the step's K/V (`write(k, v)`) and then calls `attention`."""

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        write(k, v)
        return attention(q, k, v, scale, sliding_window)

    return attend


def paged_attend(
    k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata
) -> Attend:
    return writing(
        lambda k, v: write_kv(k, v, k_cache, v_cache, metadata),
        lambda q, k, v, scale, window=None: paged_attention(
            q, k, v, k_cache, v_cache, metadata, scale, window
        ),
    )


def _to_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> Callable:
    return lambda k, v: write_slots(k, v, k_cache, v_cache, slots)


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
    query_positions: torch.Tensor | None = None,
) -> Attend:
    """A padded rectangle: `attend_rect` under `mask`, or with `kernel` the CPU's varlen
    kernel as a custom op (`graph_ops.paged_prefill_rect`) over the rectangle's real
    tokens. A sliding window's mask is made from `query_positions [R, Q]`."""

    def attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if kernel:
            return paged_prefill_rect(
                q, k_cache, v_cache, block_tables, token_order, query_start_loc, context_lens,
                scale, sliding_window or 0,
            )  # fmt: skip
        window_mask = mask
        if sliding_window:
            assert query_positions is not None, "a sliding window needs the query positions"
            num_keys = block_tables.shape[1] * k_cache.shape[2]
            per_kv = q.shape[1] // k_cache.shape[0]
            window_mask = rect_mask(query_positions, num_keys, per_kv, q.dtype, sliding_window)
        return attend_rect(q, k_cache, v_cache, block_tables, window_mask, scale)

    return writing(_to_slots(k_cache, v_cache, slots), attention)


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

    def attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if kernel:
            return paged_decode_flat(
                q, k_cache, v_cache, block_list, block_starts, context_lens, scale,
                sliding_window or 0,
            )  # fmt: skip
        valid = block_valid
        if sliding_window:
            valid = flat_window(block_valid, block_rows, block_starts, context_lens, sliding_window)
        return attend_flat(q, k_cache, v_cache, block_list, block_rows, valid, scale)

    return writing(_to_slots(k_cache, v_cache, slots), attention)


def unified_attend(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    token_rows: torch.Tensor,
    context_ends: torch.Tensor,
    shared_blocks: torch.Tensor,
    shared_starts: torch.Tensor,
    unique_blocks: torch.Tensor,
    unique_owners: torch.Tensor,
    unique_starts: torch.Tensor,
    causal: bool,
) -> Attend:
    """A unified step (`unified.attend_unified`) after writing its K/V to `slots`."""
    return writing(
        _to_slots(k_cache, v_cache, slots),
        lambda q, k, v, scale, window=None: attend_unified(
            q, k, v, k_cache, v_cache, positions, token_rows, context_ends, shared_blocks,
            shared_starts, unique_blocks, unique_owners, unique_starts, scale, causal, window,
        ),
    )
