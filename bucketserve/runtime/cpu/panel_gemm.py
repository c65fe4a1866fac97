"""A float32 CPU GEMM over a weight packed once in column panels, run by the project's C
kernel (`bucketserve/runtime/cpu/kernels`, `gemm_panels`). At decode batches it streams the
weights while it computes, where MKL's and oneDNN's packed GEMMs do one after the other;
`gemm_plan.cpu_gemm_backend` measures it against them on the running CPU."""

from __future__ import annotations

import torch

from bucketserve.runtime.cpu import kernels
from bucketserve.runtime.cpu.host_gemm import HostGemm
from bucketserve.runtime.cpu.kernels import GEMM_PANEL


def supports(shape: tuple[int, ...], dtype: torch.dtype, device_type: str = "cpu") -> bool:
    """Whether a weight of `shape` (`[out, in]`) and `dtype` on `device_type` can be
    packed: float32 on the CPU, `out` a multiple of 32, and the kernel library built."""
    return (
        dtype == torch.float32
        and device_type == "cpu"
        and len(shape) == 2
        and shape[0] % GEMM_PANEL == 0
        and kernels.load() is not None
    )


class PanelGemm(HostGemm):
    """A float32 weight `[out, in]` packed once in column panels: panel p holds output
    columns [32p, 32p + 32) as `[in, 32]`, so `panels` is `[out / 32, in, 32]`."""

    def __init__(self, weight: torch.Tensor) -> None:
        assert supports(weight.shape, weight.dtype, weight.device.type)
        self.out_features, self.in_features = weight.shape
        self._kernels = kernels.load()
        self.panels = (
            weight.view(self.out_features // GEMM_PANEL, GEMM_PANEL, self.in_features)
            .transpose(1, 2)
            .contiguous()
        )

    def _run(self, rows: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        self._kernels.gemm_panels(rows, self.panels, out, accumulate)
