"""The gated SiLU MLP (SwiGLU) of Llama-family decoders."""

from __future__ import annotations

import torch
from torch import nn

from bucketserve.runtime.cpu.gemm import linear_silu_mul
from bucketserve.runtime.layers.linear import Linear


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up stacked in one weight (`gate_up_proj`)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, gemm_parts=2)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + mlp(x)`: three GEMMs with the rest fused in; `residual` is consumed."""
        gate, up = self.gate_up_proj.gemm_weights()
        return self.down_proj.add(linear_silu_mul(x, gate, up), residual)
