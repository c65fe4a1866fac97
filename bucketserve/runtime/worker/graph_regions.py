"""The static-shape regions of a padded step that graphs mode compiles (`CompiledGraphs`):
the head (embeddings, rope rows, the rectangle's mask), one decoder layer (compiled once
per shape and reused by every layer: the layer's weights and K/V tensors are inputs, not
constants) and the tail (final norm, logits; a unified step's tail is the norm alone).
Every family runs through them: its `model.model` is a `DecoderModel` (`embed`, `rope`,
`layers`, `final_norm`)."""

from __future__ import annotations

import torch
from torch import nn

from bucketserve.runtime.attention.attend import flat_attend, rect_attend, unified_attend
from bucketserve.runtime.attention.metadata import rect_mask


def head_region(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    query_positions: torch.Tensor | None = None,
    num_keys: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Embeddings, rope table rows and the rectangle's mask of a padded step (no mask for
    a flat decode step, or where the attention kernel needs none)."""
    x = model.model.embed(input_ids, positions)
    cos_sin = model.model.rope(positions, x.dtype)
    if query_positions is None:
        return x, cos_sin, None
    mask = rect_mask(query_positions, num_keys, model.num_queries_per_kv, x.dtype)
    return x, cos_sin, mask


def layer_region(
    layer: nn.Module,
    x: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    token_order: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    query_positions: torch.Tensor,
    kernel: bool = False,
) -> torch.Tensor:
    """One decoder layer of a padded prompt rectangle (`rect_attend`; a sliding-window
    layer's mask comes from `query_positions`)."""
    attend = rect_attend(
        k_cache, v_cache, slots, block_tables, mask, token_order, query_start_loc, context_lens,
        kernel, query_positions,
    )  # fmt: skip
    return layer(x, cos_sin, attend)


def decode_layer_region(
    layer: nn.Module,
    x: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_list: torch.Tensor,
    block_rows: torch.Tensor,
    block_valid: torch.Tensor,
    block_starts: torch.Tensor,
    context_lens: torch.Tensor,
    kernel: bool = False,
) -> torch.Tensor:
    """One decoder layer of a decode step over its flat block list (`flat_attend`)."""
    attend = flat_attend(
        k_cache, v_cache, slots, block_list, block_rows, block_valid, block_starts, context_lens,
        kernel,
    )  # fmt: skip
    return layer(x, cos_sin, attend)


def unified_layer_region(
    layer: nn.Module,
    x: torch.Tensor,
    cos_sin: torch.Tensor,
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
) -> torch.Tensor:
    """One decoder layer of a unified step: flat query tokens over their own K/V and the
    shared and unique context blocks (`unified_attend`)."""
    attend = unified_attend(
        k_cache, v_cache, positions, slots, token_rows, context_ends, shared_blocks,
        shared_starts, unique_blocks, unique_owners, unique_starts, causal,
    )  # fmt: skip
    return layer(x, cos_sin, attend)


def tail_region(model: nn.Module, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(model.model.final_norm(x), rows)


def norm_region(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A unified step's tail: every token's final norm (its sampled rows, which no bucket
    dimension fixes, take the LM head after the graph)."""
    return model.model.final_norm(x)
