"""Packing a decoder's weights for the CPU backend's GEMMs, once, after loading."""

from __future__ import annotations

from collections import Counter

from torch import nn

from bucketserve.runtime.cpu.block_gemm import BlockGemm
from bucketserve.runtime.cpu.gemm_plan import GemmPlan
from bucketserve.runtime.layers.embedding import VocabEmbedding
from bucketserve.runtime.layers.linear import Linear
from bucketserve.runtime.layers.lm_head import LMHead


def pack_weights(model: nn.Module, batch_hint: int, graphs: bool = False) -> None:
    """Every GEMM of `model` (its decoder layers, `model.model.layers`, and its `lm_head`
    where it holds one) reads a copy of its weight packed for oneDNN, MKL or the panel
    GEMM, whichever measures fastest here on one layer's weights (`GemmPlan.choose`). A
    layer's packed copy replaces its plain weight; the LM head keeps its plain one beside
    (a tied embedding's lookups read it). Weights kept in quantized blocks stay as they
    are. `graphs`: packed as tensors a compiled region takes, MKL's packing beside the
    panels as in eager steps."""
    layers = model.model.layers
    linears = [m for m in layers.modules() if isinstance(m, Linear) and not m.blocks]
    if not linears:  # every GEMM weight kept in its quantized blocks
        return
    first = [m for m in layers[0].modules() if isinstance(m, Linear) and not m.blocks]
    first = first or linears[:1]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    shapes = tuple(m.gemm_shape for m in first)
    plan = GemmPlan.choose(first[0].weight.dtype, shapes, weight_bytes, batch_hint, graphs)
    for module in linears:
        module.pack(plan)
    head = getattr(model, "lm_head", None)
    if isinstance(head, LMHead) and head.packed is None:
        head.pack(plan)


def describe_weights(model: nn.Module) -> tuple[str, int]:
    """What format the model's weights run in ("Q4_1 x 210, float32 x 61", tensors per
    format) and their resident bytes, before packing."""
    formats: Counter[str] = Counter()
    resident = 0
    for module in model.modules():
        for part in (p for gemm in _block_gemms(module) for p in gemm.parts):
            formats[part.block_type] += 1
            resident += part.blocks.numel()
        for param in module.parameters(recurse=False):
            if param.numel():
                formats[str(param.dtype).removeprefix("torch.")] += 1
                resident += param.numel() * param.element_size()
    return ", ".join(f"{kind} x {n}" for kind, n in formats.most_common()), resident


def _block_gemms(module: nn.Module) -> tuple[BlockGemm, ...]:
    if isinstance(module, Linear) and module.blocks:
        return module.packed
    if isinstance(module, VocabEmbedding) and module.blocks is not None:
        return (module.blocks,)
    if isinstance(module, LMHead) and not module._tied and isinstance(module.packed, BlockGemm):
        return (module.packed,)
    return ()
