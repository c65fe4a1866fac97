"""Attention of a unified step (the unified strategy of [Bucketing], docs/references.md): prompt
chunks and decode rows as one flat run of query tokens, from tensors alone so a graph compiler
takes it. Each token attends three parts, joined in one softmax: the step's own new tokens
(causally within its row, or only itself where no row has more than one), the shared context
blocks (read by two or more of the step's tokens: a dense score block over all tokens, masked to
the rows that hold each block) and the unique ones (each read by one token: its scores alone).
With a sliding window w a token at position p sees keys p - w + 1..p alone, in each part."""

from __future__ import annotations

import torch

# the key position a token is given for a shared block its row does not hold: past any
# context, so the block is masked out for it
NOT_HELD = 1 << 40


def attend_unified(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    token_rows: torch.Tensor,
    context_ends: torch.Tensor,
    shared_blocks: torch.Tensor,
    shared_starts: torch.Tensor,
    unique_blocks: torch.Tensor,
    unique_owners: torch.Tensor,
    unique_starts: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Queries `q [T, heads, dim]` and the step's own `k`, `v [T, kv_heads, dim]`.

    Token t is at `positions[t]` in row `token_rows[t]`, whose context (tokens before this
    step) ends at `context_ends[t]`. Shared block i (`shared_blocks [S]`) holds, for token
    t, the keys from position `shared_starts[t, i]` on (NOT_HELD: not its row's); unique
    block j (`unique_blocks [U]`) is read by token `unique_owners[j]` alone, its keys from
    `unique_starts[j]`. Only keys before the row's context end count; padding blocks and
    tokens carry no such key, and a padding token sees itself alone. With `sliding_window`
    w a key also counts only after `positions[t] - w`."""
    tokens, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[0], k_cache.shape[2]
    qg = q.view(tokens, kv_heads, heads // kv_heads, dim)
    offsets = torch.arange(block_size, device=q.device)
    neg = float("-inf")

    if causal:  # [T, kv, g, T]: a row's new tokens, up to the query's own position
        own = torch.einsum("tkgd,ukd->tkgu", qg, k) * scale
        same_row = token_rows[:, None] == token_rows[None, :]
        allowed = same_row & (positions[None, :] <= positions[:, None])
        if sliding_window:
            allowed = allowed & (positions[None, :] > positions[:, None] - sliding_window)
        own = own.masked_fill(~allowed[:, None, None, :], neg)
    else:  # [T, kv, g, 1]: one token a row, itself
        own = (qg * k[:, :, None, :]).sum(-1, keepdim=True) * scale
    row_max = own.amax(-1)

    shared = unique = None
    if shared_blocks.shape[0]:
        n = shared_blocks.shape[0] * block_size
        ks = k_cache.index_select(1, shared_blocks).reshape(kv_heads, n, dim)
        vs = v_cache.index_select(1, shared_blocks).reshape(kv_heads, n, dim)
        keys = (shared_starts[:, :, None] + offsets).reshape(tokens, n)
        seen = keys < context_ends[:, None]
        if sliding_window:
            seen = seen & (keys > positions[:, None] - sliding_window)
        scores = torch.einsum("tkgd,knd->tkgn", qg, ks) * scale
        scores = scores.masked_fill(~seen[:, None, None, :], neg)
        row_max = torch.maximum(row_max, scores.amax(-1))
        shared = (scores, vs)
    if unique_blocks.shape[0]:
        ku = k_cache.index_select(1, unique_blocks)  # [kv, U, block, dim]
        vu = v_cache.index_select(1, unique_blocks)
        ends = context_ends.index_select(0, unique_owners)
        seen = unique_starts[:, None] + offsets < ends[:, None]
        if sliding_window:
            first = positions.index_select(0, unique_owners) - sliding_window
            seen = seen & (unique_starts[:, None] + offsets > first[:, None])
        scores = torch.einsum("ukgd,kusd->ukgs", qg.index_select(0, unique_owners), ku) * scale
        scores = scores.masked_fill(~seen[:, None, None, :], neg)
        row_max = row_max.index_reduce(0, unique_owners, scores.amax(-1), "amax")
        unique = (scores, vu)

    p = torch.exp(own - row_max.unsqueeze(-1))
    total = p.sum(-1)
    out = torch.einsum("tkgu,ukd->tkgd", p, v) if causal else p * v[:, :, None, :]
    if shared is not None:
        scores, vs = shared
        p = torch.exp(scores - row_max.unsqueeze(-1))
        total = total + p.sum(-1)
        out = out + torch.einsum("tkgn,knd->tkgd", p, vs)
    if unique is not None:
        scores, vu = unique
        p = torch.exp(scores - row_max.index_select(0, unique_owners).unsqueeze(-1))
        total = total.index_add(0, unique_owners, p.sum(-1))
        out = out.index_add(0, unique_owners, torch.einsum("ukgs,kusd->ukgd", p, vu))
    return (out / total.unsqueeze(-1)).reshape(tokens, heads, dim)
