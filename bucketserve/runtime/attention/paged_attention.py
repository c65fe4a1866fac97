"""Paged attention over the KV pool: writing a step's K/V into its slots, and attending
through the block tables (the C kernels on CPU, a gather + SDPA elsewhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bucketserve.runtime.attention.metadata import AttentionGroup, AttentionMetadata
from bucketserve.runtime.cpu import kernels


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    """Store the step's K/V `[T, kv_heads, head_dim]` into their pool slots."""
    write_slots(k, v, k_cache, v_cache, metadata.write_slots)


def write_slots(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """In place into the layer's own cache tensors (graph-capturable: they are inputs);
    `slots` hold no padding (-1)."""
    kernel = kernels.for_tensors(k.dtype, k.device)
    if kernel and kernel.writes(k, v, k_cache, v_cache):
        kernel.write_kv(k, v, k_cache, v_cache, slots.contiguous())
        return
    heads, dim = k.shape[1], k.shape[2]
    k_cache.view(heads, -1, dim).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(heads, -1, dim).index_copy_(1, slots, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the step's queries `[T, heads, head_dim]` over each row's context;
    `k`, `v` `[T, kv_heads, head_dim]` are the step's own (already written to the pool).
    With `sliding_window` w the query at position p sees keys p - w + 1..p alone."""
    if metadata.varlen:
        kernel = kernels.load()
        return kernel.paged_prefill(
            q, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc,
            metadata.context_lens, scale, sliding_window,
        )  # fmt: skip
    groups = metadata.groups
    if len(groups) == 1 and groups[0].gather_index is None and not metadata.causal_spans:
        return _attend(q, k_cache, v_cache, groups[0], scale, sliding_window)
    out = torch.empty_like(q)
    for start, end in metadata.causal_spans:
        mask = None
        if sliding_window and end - start > sliding_window:
            mask = metadata.span_mask(end - start, sliding_window, q.dtype)
        out[start:end] = _attend_causal(q[start:end], k[start:end], v[start:end], scale, mask)
    for group in groups:
        o = _attend(
            q.index_select(0, group.gather_index), k_cache, v_cache, group, scale, sliding_window
        )
        if group.valid_slots is not None:
            o = o.index_select(0, group.valid_slots)
        out.index_copy_(0, group.tokens, o)
    return out


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One rectangle: gather each row's blocks (one index_select per tensor, each head's
    keys contiguous), then SDPA with the queries of a KV head stacked, so grouped-query
    attention repeats no K/V. Decode rows on a CPU go to the kernel instead."""
    if group.context_lens is not None:
        kernel = kernels.load()
        return kernel.paged_decode(
            q, k_cache, v_cache, group.block_tables, group.context_lens, scale, None,
            sliding_window,
        )  # fmt: skip
    mask = group.window_mask(sliding_window) if sliding_window else group.attn_mask
    return attend_rect(q, k_cache, v_cache, group.block_tables, mask, scale)


def attend_rect(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`_attend` from tensors alone: queries `[R * Q, heads, dim]`, tables `[R, NB]`."""
    rows = block_tables.shape[0]
    queries = q.shape[0] // rows
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[0]
    per_kv = heads // kv_heads
    q = q.view(rows, queries, kv_heads, per_kv, dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(rows, kv_heads, per_kv * queries, dim)
    blocks = block_tables.reshape(-1)
    k = k_cache.index_select(1, blocks).view(kv_heads, rows, -1, dim).transpose(0, 1)
    v = v_cache.index_select(1, blocks).view(kv_heads, rows, -1, dim).transpose(0, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    out = out.view(rows, kv_heads, per_kv, queries, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(rows * queries, heads, dim)


def _attend_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One prompt chunk over itself: SDPA's flash kernel (4-D inputs only, else the math
    path) on contiguous `[1, heads, n, dim]`, its fast layout; K/V are repeated per query
    head, which costs little next to the rest. `mask`: a sliding window's (`span_mask`)
    in place of the causal one."""
    per_kv = q.shape[1] // k.shape[1]
    q = q.transpose(0, 1).contiguous().unsqueeze(0)
    k = k.transpose(0, 1).repeat_interleave(per_kv, dim=0).unsqueeze(0)
    v = v.transpose(0, 1).repeat_interleave(per_kv, dim=0).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale
    )
    return out[0].transpose(0, 1)


def attend_flat(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_list: torch.Tensor,
    block_rows: torch.Tensor,
    block_valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode rows (one query each, `q [R, heads, dim]`) over the flat list of their blocks
    (vllm-gaudi's layout): `block_list [NB]` the batch's blocks, `block_rows [NB]` whose
    each is, `block_valid [NB, block_size]` which slots hold context. Scores per block,
    a softmax per row across its blocks, so a ragged batch pads only its total block
    count; padding blocks (no valid slot) and rows without blocks add nothing."""
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    per_kv = heads // kv_heads
    k = k_cache.index_select(1, block_list)  # [kv_heads, NB, block_size, dim]
    v = v_cache.index_select(1, block_list)
    qb = q.view(rows, kv_heads, per_kv, dim).index_select(0, block_rows)
    scores = torch.einsum("nkpd,knsd->nkps", qb, k) * scale
    scores = scores.masked_fill(~block_valid[:, None, None, :], float("-inf"))
    row_max = torch.full((rows, kv_heads, per_kv), float("-inf"), dtype=q.dtype, device=q.device)
    row_max = row_max.index_reduce(0, block_rows, scores.amax(-1), "amax")
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    p = torch.exp(scores - row_max.index_select(0, block_rows).unsqueeze(-1))
    total = torch.zeros_like(row_max).index_add(0, block_rows, p.sum(-1))
    out = torch.zeros((rows, kv_heads, per_kv, dim), dtype=q.dtype, device=q.device)
    out = out.index_add(0, block_rows, torch.einsum("nkps,knsd->nkpd", p, v))
    out = out / total.clamp_min(torch.finfo(q.dtype).tiny).unsqueeze(-1)
    return out.reshape(rows, heads, dim)


def flat_window(
    block_valid: torch.Tensor,
    block_rows: torch.Tensor,
    block_starts: torch.Tensor,
    context_lens: torch.Tensor,
    sliding_window: int,
) -> torch.Tensor:
    """`attend_flat`'s `block_valid` narrowed to a sliding window: row r's one query, at
    position `context_lens[r] - 1`, sees its last `sliding_window` context slots alone
    (block n is block `n - block_starts[block_rows[n]]` of its row)."""
    block_size = block_valid.shape[1]
    index = torch.arange(block_rows.shape[0], device=block_rows.device)
    index = index - block_starts.index_select(0, block_rows)
    keys = index.unsqueeze(1) * block_size + torch.arange(block_size, device=index.device)
    first = context_lens.index_select(0, block_rows).to(keys.dtype) - sliding_window
    return block_valid & (keys >= first.unsqueeze(1))
