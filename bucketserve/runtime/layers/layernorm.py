"""RMSNorm, on the CPU kernel where it runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bucketserve.runtime.cpu import kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = kernels.for_tensors(x.dtype, x.device)
        if kernel and x.is_contiguous() and self.weight.dtype == x.dtype:
            return kernel.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
