"""A decoder layer's self-attention over the paged KV cache, as the families configure it."""

from __future__ import annotations

import torch
from torch import nn

from bucketserve.runtime.attention.attend import Attend
from bucketserve.runtime.distributed import tp_group
from bucketserve.runtime.layers.layernorm import RMSNorm
from bucketserve.runtime.layers.linear import Linear
from bucketserve.runtime.layers.parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    kv_heads,
    split_rows,
)
from bucketserve.runtime.layers.rotary_embedding import apply_rope


class SelfAttention(nn.Module):
    """q, k and v in one stacked GEMM (`qkv_proj`), per-head RMSNorms of q and k where the
    family has them (`qk_norm_eps`; Gemma's `1 + weight` with `unit_offset`), the rotary
    embedding (`rope`), the step's `attend` (within `sliding_window` tokens if set) and the
    output projection (`o_proj`). `scale`: the score scale, `head_dim ** -0.5` if None.
    Built under a tensor-parallel group (`tp_group.building`), it holds this rank's heads:
    q/k/v column-parallel, `o_proj` row-parallel; `num_heads`, `num_kv_heads` are then
    the rank's."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        scale: float | None = None,
        qk_norm_eps: float | None = None,
        unit_offset: bool = False,
        rope: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        tp = tp_group.current()
        q_heads, kv = (0, num_heads), (0, num_kv_heads)
        if tp is not None:
            q_heads, kv = split_rows(num_heads, tp), kv_heads(num_kv_heads, tp)
        self.num_heads = q_heads[1]
        self.num_kv_heads = kv[1]
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.rope = rope
        self.sliding_window = sliding_window  # a python int: a constant inside a graph
        kv_size = self.num_kv_heads * head_dim
        if tp is None:
            self.qkv_proj = Linear(hidden_size, [self.q_size, kv_size, kv_size], bias=qkv_bias)
            self.o_proj = Linear(self.q_size, hidden_size, bias=o_bias)
        else:
            q_rows = (q_heads[0] * head_dim, self.q_size)
            kv_rows = (kv[0] * head_dim, kv_size)
            self.qkv_proj = ColumnParallelLinear(
                hidden_size, [q_rows, kv_rows, kv_rows], bias=qkv_bias
            )
            self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, o_bias, tp)
        self.qk_norm = qk_norm_eps is not None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        attend: Attend,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`residual + attention(x)` (one fused GEMM; `residual` is consumed), or without
        a residual the attention output alone. `attend` writes K/V to the cache and
        attends."""
        tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(tokens, heads + 2 * kv_heads, self.head_dim)
        if self.qk_norm:
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
            # copies the RMSNorm kernel takes (strided heads would fall back to torch's)
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
            if self.rope:
                q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
        else:
            qk, v = qkv.split([heads + kv_heads, kv_heads], dim=1)
            if self.rope:
                qk = apply_rope(qk, cos_sin)
            q, k = qk.split([heads, kv_heads], dim=1)
        if self.sliding_window is None:
            out = attend(q, k, v, self.scale)
        else:
            out = attend(q, k, v, self.scale, sliding_window=self.sliding_window)
        out = out.reshape(tokens, self.q_size)
        return self.o_proj(out) if residual is None else self.o_proj.add(out, residual)
