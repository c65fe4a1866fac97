"""The CPU GEMMs the layers call, over a weight packed once (`pack_weight`) by oneDNN, MKL's
packed sgemm or the kernels' column panels; a plain weight (any device) runs `F.linear`.
Which backend packs a model's weights is `GemmPlan`'s choice (`gemm_plan.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bucketserve.runtime.cpu import kernels, onednn, panel_gemm
from bucketserve.runtime.cpu.graph_ops import PanelWeight, gemm, is_panels
from bucketserve.runtime.cpu.host_gemm import HostGemm, RowSplitGemm
from bucketserve.runtime.cpu.mkl_sgemm import PackedSgemm
from bucketserve.runtime.cpu.panel_gemm import PanelGemm

Weight = torch.Tensor | HostGemm | PanelWeight  # what the GEMMs below take


def pack_weight(
    weight: torch.Tensor, batch_hint: int, backend: str = "onednn", large_rows: int | None = None
) -> Weight:
    """`weight [out, in]` packed once for GEMMs of about `batch_hint` rows by `backend`:
    oneDNN's blocked layout, MKL's packed sgemm or the kernels' column panels (float32);
    or `weight` itself where none runs it. Only the GEMMs below take the result: it is
    opaque to every other op. With `large_rows`, the panel GEMM's weight is also packed
    for MKL, which runs the GEMMs of at least that many rows (prefill chunks)."""
    if backend == "mkl" and weight.dtype == torch.float32 and weight.device.type == "cpu":
        return PackedSgemm(weight, batch_hint)
    if backend == "kernels" and panel_gemm.supports(weight.shape, weight.dtype, weight.device.type):
        if large_rows:  # GemmPlan gives it only where MKL runs
            large = PackedSgemm(weight, large_rows)
            return RowSplitGemm(PanelGemm(weight), large, large_rows)
        return PanelGemm(weight)
    if not onednn.runs(weight):
        return weight
    return onednn.pack(weight, batch_hint)


def pack_graph_weight(
    weight: torch.Tensor, batch_hint: int, backend: str, large_rows: int | None = None
) -> torch.Tensor | PanelWeight:
    """`pack_weight` for graphs mode, where a packed weight must be made of tensors (a
    compiled region's inputs): the panel GEMM's panels, with MKL's packing beside them for
    `large_rows` (`graph_ops.gemm` runs them); oneDNN's blocked layout otherwise (MKL's
    packing alone is not a weight a graph can tell from a plain one)."""
    if backend == "kernels" and panel_gemm.supports(weight.shape, weight.dtype, weight.device.type):
        large = PackedSgemm(weight, large_rows).buffer if large_rows else None
        return PanelWeight(PanelGemm(weight).panels, large, large_rows or 0)
    packed = pack_weight(weight, batch_hint)
    return packed if isinstance(packed, torch.Tensor) else weight


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through oneDNN, MKL's packed GEMM or the panel GEMM on CPU."""
    if is_panels(weight):
        out = gemm(x, weight)
        return out if bias is None else out + bias
    if isinstance(weight, HostGemm):
        out = weight(x)
        return out if bias is None else out.add_(bias)
    if onednn.runs(x):
        return onednn.linear_pointwise(x, weight, bias, "none")
    return F.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, gate: Weight, up: Weight) -> torch.Tensor:
    """SwiGLU's `silu(x @ gate.T) * (x @ up.T)`: on CPU two GEMMs with the rest fused into
    them (oneDNN) or into one C pass after them (MKL, the panel GEMM)."""
    if is_panels(gate):
        return F.silu(gemm(x, gate)) * gemm(x, up)
    if isinstance(gate, HostGemm):
        g, u = gate(x), up(x)
        kernel = kernels.for_tensors(g.dtype, g.device)
        return kernel.silu_mul(g, u, g) if kernel else F.silu(g, inplace=True).mul_(u)
    if onednn.runs(x):
        swish = onednn.linear_pointwise(x, gate, None, "swish")
        return onednn.linear_binary(x, swish, up, None, "mul")
    return F.silu(F.linear(x, gate)).mul_(F.linear(x, up))


def linear_add(
    x: torch.Tensor, weight: Weight, other: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ weight.T + bias + other` (a residual), one fused GEMM on CPU. `other` is
    consumed: MKL and the panel GEMM accumulate into it in place when it is contiguous
    (callers pass a residual stream they own), oneDNN fuses the add into its output."""
    if is_panels(weight):
        out = gemm(x, weight, other)
        return out if bias is None else out + bias
    if isinstance(weight, HostGemm):
        if not other.is_contiguous():
            other = other.contiguous()
        out = weight(x, accumulate=other)
        return out if bias is None else out.add_(bias)
    if onednn.runs(x):
        return onednn.linear_binary(x, other, weight, bias, "add")
    return F.linear(x, weight, bias).add_(other)
