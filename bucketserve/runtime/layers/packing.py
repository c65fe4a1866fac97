"""Packing a decoder's weights for the CPU backend's GEMMs, once, after loading."""

from __future__ import annotations

from torch import nn

from bucketserve.runtime.cpu.gemm_plan import GemmPlan
from bucketserve.runtime.layers.linear import Linear
from bucketserve.runtime.layers.lm_head import LMHead


def pack_weights(model: nn.Module, batch_hint: int, graphs: bool = False) -> None:
    """Every GEMM of `model` (its decoder layers, `model.model.layers`, and its `lm_head`
    where it holds one) reads a copy of its weight packed for oneDNN, MKL or the panel
    GEMM, whichever measures fastest here on one layer's weights (`GemmPlan.choose`). A
    layer's packed copy replaces its plain weight; the LM head keeps its plain one beside
    (a tied embedding's lookups read it). `graphs`: packed as tensors a compiled region
    takes, MKL's packing beside the panels as in eager steps."""
    layers = model.model.layers
    linears = [m for m in layers.modules() if isinstance(m, Linear)]
    first = [m for m in layers[0].modules() if isinstance(m, Linear)]  # a stage holds >= 1
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    shapes = tuple(m.gemm_shape for m in first)
    plan = GemmPlan.choose(first[0].weight.dtype, shapes, weight_bytes, batch_hint, graphs)
    for module in linears:
        module.pack(plan)
    head = getattr(model, "lm_head", None)
    if isinstance(head, LMHead):
        head.pack(plan)
