"""The feed-forward blocks: gated (SwiGLU, GeGLU) and plain two-layer MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bucketserve.runtime.cpu.gemm import linear, linear_silu_mul
from bucketserve.runtime.distributed import tp_group
from bucketserve.runtime.layers.linear import Linear
from bucketserve.runtime.layers.parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    split_rows,
)


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up stacked in one weight (`gate_up_proj`);
    `act` is "silu" (Llama, Qwen, Mistral) or "gelu_pytorch_tanh" (Gemma). Under a
    tensor-parallel group: this rank's share of the intermediate units, gate/up
    column-parallel, down row-parallel."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False
    ) -> None:
        super().__init__()
        tp = tp_group.current()
        if tp is None:
            self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, bias, gemm_parts=2)
            self.down_proj = Linear(intermediate_size, hidden_size, bias)
        else:
            rows = split_rows(intermediate_size, tp)
            self.gate_up_proj = ColumnParallelLinear(hidden_size, [rows] * 2, bias, gemm_parts=2)
            self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)
        self.act = act

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`residual + mlp(x)`, `residual` consumed; without one, `mlp(x)`."""
        gate, up = self.gate_up_proj.gemm_weights()
        bias = self.gate_up_proj.bias
        if self.act == "silu" and bias is None:
            hidden = linear_silu_mul(x, gate, up)  # three GEMMs with the rest fused in
        else:
            gate_bias, up_bias = (None, None) if bias is None else bias.chunk(2)
            g, u = linear(x, gate, gate_bias), linear(x, up, up_bias)
            if self.act == "silu":
                hidden = F.silu(g).mul_(u)
            else:
                hidden = F.gelu(g, approximate="tanh").mul_(u)
        if residual is None:
            return self.down_proj(hidden)
        return self.down_proj.add(hidden, residual)


class MLP(nn.Module):
    """`fc2(relu(fc1(x)))` with biases (OPT); fc1 column-, fc2 row-parallel under a
    tensor-parallel group."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = True) -> None:
        super().__init__()
        tp = tp_group.current()
        if tp is None:
            self.fc1 = Linear(hidden_size, intermediate_size, bias)
            self.fc2 = Linear(intermediate_size, hidden_size, bias)
        else:
            rows = split_rows(intermediate_size, tp)
            self.fc1 = ColumnParallelLinear(hidden_size, [rows], bias)
            self.fc2 = RowParallelLinear(intermediate_size, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        hidden = F.relu(self.fc1(x))
        return self.fc2(hidden) if residual is None else self.fc2.add(hidden, residual)
