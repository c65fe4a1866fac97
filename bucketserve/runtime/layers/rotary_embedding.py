"""Llama's (neox-style) rotary position embedding, with the rope scalings in use, and
several bases side by side (Gemma 3's local and global layers)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from bucketserve.runtime.cpu import kernels
from bucketserve.runtime.io.model_config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The rotation frequencies, scaled as `scaling` says: `linear`, or `llama3` (low
    frequencies divided by the factor, high ones kept, a smooth blend between)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    old_len = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin table for every position; looked up once per step."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        # on the meta device (`CausalLM.build`) only the shape: `reset` fills it, and meta
        # kernels for these ops would import torch._dynamo (seconds a process)
        meta = torch.empty(0).is_meta
        table = torch.empty(max_positions, 2 * head_dim) if meta else self._table()
        self.register_buffer("cos_sin", table, persistent=False)

    def _table(self) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # sin carries rotate_half's sign: rotate_half(x) * sin == x.roll(half) * signed_sin
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos, -sin, sin), dim=-1)

    def reset(self) -> None:
        """Refill the table (after `to_empty`); computed in float32 on the CPU."""
        with torch.device("cpu"):
            table = self._table()
        self.cos_sin.copy_(table)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`[T, 1, 2 * head_dim]` (cos | signed sin) for the step's positions."""
        return self.cos_sin.index_select(0, positions).to(dtype).unsqueeze(1)


class RotaryEmbeddings(nn.Module):
    """One table per `(theta, scaling)` base over the same head size; a step's rows of
    every table, stacked `[bases, T, 1, 2 * head_dim]`, of which each layer takes its own
    (`[i]`, contiguous)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        bases: Sequence[tuple[float, RopeScaling | None]],
    ) -> None:
        super().__init__()
        self.tables = nn.ModuleList(
            RotaryEmbedding(head_dim, max_positions, theta, scaling) for theta, scaling in bases
        )

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.stack([table(positions, dtype) for table in self.tables])


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of `x [T, heads, head_dim]`: in place where the CPU kernel
    runs, else a new tensor."""
    kernel = kernels.for_tensors(x.dtype, x.device)
    if (
        kernel
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cos_sin.is_contiguous()
        and cos_sin.dtype == x.dtype
    ):
        return kernel.rope_(x, cos_sin)
    return rope_reference(x, cos_sin)


def rope_reference(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in torch ops, into a new tensor."""
    cos, signed_sin = cos_sin.chunk(2, dim=-1)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
