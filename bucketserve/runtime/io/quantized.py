"""Weights kept as a GGUF file stores them: llama.cpp's quantized blocks (32 weights, 256 for
the K types)."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

# The block types the CPU kernels multiply in place (`cpu_kernels.c`: `block_gemm_f32`
# numbers them in this order); a GGUF tensor of another type is expanded to float32.
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")
QUANTIZATION_MODES = ("auto", "none")


def block_bytes(block_type: str) -> tuple[int, int]:
    """(weights, bytes) of one block of `block_type`."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[block_type]]


@dataclass(frozen=True)
class QuantizedTensor:
    """A `[rows, in_features]` weight as its blocks: uint8 `[rows, in_features / block
    weights * block bytes]`, each row its blocks in order."""

    blocks: torch.Tensor
    block_type: str

    @property
    def shape(self) -> tuple[int, int]:
        weights, size = block_bytes(self.block_type)
        return self.blocks.shape[0], self.blocks.shape[1] // size * weights
