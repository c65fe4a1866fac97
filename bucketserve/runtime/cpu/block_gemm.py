"""A CPU GEMM over a weight kept in llama.cpp's quantized blocks, as a GGUF file stores it:
32 weights a block (or 256 a K-type super-block), float16 scales, 4 to 8 bits a weight.
Decode reads every weight once a step, and a Q4 weight is ~7x fewer bytes to stream than
its float32 expansion. The kernel (`cpu_kernels.c`, `block_gemm_f32`) quantizes x to 8 bits
per 32 values and multiplies integers, as llama.cpp's CPU backend does."""

from __future__ import annotations

import torch

from bucketserve.runtime.cpu import kernels
from bucketserve.runtime.cpu.host_gemm import HostGemm
from bucketserve.runtime.io.quantized import QuantizedTensor

# From this many rows of x (prompt chunks) a call expands the weight to float32 and runs
# torch's GEMM (MKL / oneDNN) with x unquantized: 1.1-1.9x faster than the integer kernel
# there on Zen 3 (AVX2), mixed at 128 rows, slower below (`benchmarks/block_gemm.py`).
PROMPT_ROWS = 256
# ... unless the expansion would be larger than this (an LM head over a big vocabulary,
# asked for a long prompt's logprobs).
PROMPT_EXPANSION_BYTES = 64 << 20


def runs_blocks() -> bool:
    """Whether weights can stay in blocks here: the kernel library is built."""
    return kernels.load() is not None


class BlockGemm(HostGemm):
    """`x @ W.T` with W `[out, in]` kept in blocks: one `QuantizedTensor`, or the row ranges
    of a stacked weight whose parts the file quantized differently (Gemma's q and k in
    Q5_0, v in Q8_0), each computed into its columns of the output."""

    def __init__(self, *parts: QuantizedTensor) -> None:
        self.parts = parts
        self.out_features = sum(p.shape[0] for p in parts)
        self.in_features = parts[0].shape[1]
        self._kernels = kernels.load()

    @property
    def nbytes(self) -> int:
        return sum(p.blocks.numel() for p in self.parts)

    def _run(self, rows: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        if rows.shape[0] >= PROMPT_ROWS and out.numel() // rows.shape[0] * self.in_features * 4 \
                <= PROMPT_EXPANSION_BYTES:
            dense = torch.cat([self._expand(p) for p in self.parts]).T
            if accumulate:
                out.addmm_(rows, dense)
            else:
                torch.mm(rows, dense, out=out)
            return
        start = 0
        for p in self.parts:
            end = start + p.shape[0]
            self._kernels.block_gemm(rows, p.blocks, p.block_type, out[:, start:end], accumulate)
            start = end

    def _expand(self, part: QuantizedTensor) -> torch.Tensor:
        ids = torch.arange(part.shape[0])
        return self._kernels.block_rows(part.blocks, part.block_type, ids, self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` of W (one part), shaped `[*ids.shape, in]` (an embedding's
        lookup)."""
        (w,) = self.parts
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = self._kernels.block_rows(w.blocks, w.block_type, flat, self.in_features)
        return out.view(*ids.shape, self.in_features)

    def chunk(self, count: int) -> tuple[BlockGemm, ...]:
        """W's rows as `count` GEMMs of equal height (gate and up of a stacked weight)."""
        height, chunks = self.out_features // count, []
        for first in range(0, self.out_features, height):
            parts, start = [], 0
            for p in self.parts:
                lo, hi = max(first, start), min(first + height, start + p.shape[0])
                if lo < hi:
                    parts.append(QuantizedTensor(p.blocks[lo - start : hi - start], p.block_type))
                start += p.shape[0]
            chunks.append(BlockGemm(*parts))
        return tuple(chunks)
