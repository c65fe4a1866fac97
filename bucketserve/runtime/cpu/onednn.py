"""oneDNN's fp32/bf16 GEMM over a weight in its blocked layout, with an activation or a
binary op fused into the GEMM's output (one pass over the activations saved per fused op).

The fused calls are also custom ops with fake kernels, so a compiled graph (graphs mode)
keeps calling them (inductor's own CPU GEMM is MKL's unpacked one) while it fuses the
elementwise work between them."""

from __future__ import annotations

import torch

_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
AVAILABLE = _LINEAR is not None and torch.backends.mkldnn.is_available()
_DTYPES = {torch.float32} | (
    {torch.bfloat16} if AVAILABLE and torch.ops.mkldnn._is_mkldnn_bf16_supported() else set()
)


def runs(x: torch.Tensor) -> bool:
    """Whether oneDNN runs GEMMs over `x` (a CPU tensor of a dtype it computes)."""
    return AVAILABLE and x.device.type == "cpu" and x.dtype in _DTYPES


def pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """`weight [out, in]` in oneDNN's blocked layout for GEMMs of about `batch_hint` rows
    (the plain layout is re-blocked inside every call)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)


@torch.library.custom_op("bucketserve::onednn_linear", mutates_args=())
def _linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, attr: str
) -> torch.Tensor:
    return _LINEAR(x, weight, bias, attr, [], "")


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, attr: str):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("bucketserve::onednn_linear_binary", mutates_args=())
def _binary_op(
    x: torch.Tensor, other: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, op: str
) -> torch.Tensor:
    return _LINEAR.binary(x, other, weight, bias, op)


@_binary_op.register_fake
def _(x, other, weight, bias, op):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear_pointwise(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, attr: str
) -> torch.Tensor:
    """`attr(x @ weight.T + bias)`, `attr` one of oneDNN's ("none", "swish", ...)."""
    if torch.compiler.is_compiling():
        return _linear_op(x, weight, bias, attr)
    return _LINEAR(x, weight, bias, attr, [], "")


def linear_binary(
    x: torch.Tensor,
    other: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    op: str,
) -> torch.Tensor:
    """`(x @ weight.T + bias) op other`, `op` one of oneDNN's ("add", "mul", ...)."""
    if torch.compiler.is_compiling():
        return _binary_op(x, other, weight, bias, op)
    return _LINEAR.binary(x, other, weight, bias, op)
