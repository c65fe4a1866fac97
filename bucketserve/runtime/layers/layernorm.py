"""The norms the families use: RMSNorm (on the CPU kernel where it runs), with Gemma's
`1 + weight` scale as an option, and LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bucketserve.runtime.cpu import kernels


class RMSNorm(nn.Module):
    """`x / rms(x) * weight`. `unit_offset` (Gemma): checkpoints store `weight - 1`; the
    loader adds the 1 back once (`weight_loader`), so the forward is the same."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.copy_(loaded.float() + 1.0 if self.unit_offset else loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = kernels.for_tensors(x.dtype, x.device)
        if kernel and x.is_contiguous() and self.weight.dtype == x.dtype:
            return kernel.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


LayerNorm = nn.LayerNorm
