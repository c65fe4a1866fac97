"""The linear layer every model family shares, over the CPU backend's packed GEMMs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from bucketserve.runtime.cpu.block_gemm import BlockGemm
from bucketserve.runtime.cpu.gemm import Weight, linear, linear_add
from bucketserve.runtime.cpu.gemm_plan import GemmPlan
from bucketserve.runtime.io.quantized import QuantizedTensor


class Linear(nn.Linear):
    """`nn.Linear` whose GEMMs may read packed copies of its weight (`pack`).

    `output_sizes`: the output shards a checkpoint stores apart and this weight stacks
    (q, k, v; gate, up), each loaded into its rows (`shard_rows`); `gemm_parts`: the row
    blocks its GEMMs use apart (gate and up), each packed on its own. A weight kept in a
    GGUF's quantized blocks (`load_blocks`) runs the block GEMM and is never packed.
    """

    packed: tuple[Weight, ...] | None = None

    def __init__(
        self,
        in_features: int,
        output_sizes: int | Sequence[int],
        bias: bool = False,
        gemm_parts: int = 1,
    ) -> None:
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        super().__init__(in_features, sum(sizes), bias=bias)
        self.output_sizes = sizes
        self.gemm_parts = gemm_parts

    @property
    def gemm_shape(self) -> tuple[int, int]:
        """`[out, in]` of one GEMM's weight."""
        return self.out_features // self.gemm_parts, self.in_features

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """(first row, rows) of output shard `shard` in the stacked weight."""
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]

    def load_blocks(self, tensor: QuantizedTensor, shard: int | None) -> None:
        """Keep output shard `shard`'s weight (all of it for None) in its blocks; once every
        shard has come, the GEMMs run on them and the float weight is dropped."""
        rows = self.out_features if shard is None else self.shard_rows(shard)[1]
        if tensor.shape != (rows, self.in_features):
            raise ValueError(
                f"quantized weight of shape {tensor.shape}, expected {(rows, self.in_features)}"
            )
        parts = self.__dict__.setdefault("_block_shards", {})
        parts[shard or 0] = tensor
        if len(parts) < len(self.output_sizes):
            return
        runs: list[list[QuantizedTensor]] = []  # neighbouring shards of one type, joined
        for i in range(len(parts)):
            if runs and runs[-1][0].block_type == parts[i].block_type:
                runs[-1].append(parts[i])
            else:
                runs.append([parts[i]])
        joined = [QuantizedTensor(torch.cat([t.blocks for t in r]), r[0].block_type) for r in runs]
        self.packed = BlockGemm(*joined).chunk(self.gemm_parts)
        self.weight = nn.Parameter(self.weight.new_empty((0, self.in_features)), False)
        del self._block_shards

    @property
    def blocks(self) -> bool:
        """Whether the weight is kept in quantized blocks."""
        return self.packed is not None and isinstance(self.packed[0], BlockGemm)

    def pack(self, plan: GemmPlan) -> None:
        """From now on the GEMMs read copies packed as `plan` says, and the plain weight is
        dropped (it would double the layer's memory) unless packing kept it as it was."""
        chunks = self.weight.chunk(self.gemm_parts)
        self.packed = tuple(plan.pack(w) for w in chunks)
        if all(p is not w for p, w in zip(self.packed, chunks, strict=True)):
            self.weight = nn.Parameter(self.weight.new_empty((0, self.in_features)), False)

    def gemm_weights(self) -> tuple[Weight, ...]:
        """The weight of each of the `gemm_parts` GEMMs, packed where `pack` ran."""
        return self.packed if self.packed is not None else self.weight.chunk(self.gemm_parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.gemm_weights()[0], self.bias)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)` in one fused GEMM; `residual` is consumed (`linear_add`)."""
        return linear_add(x, self.gemm_weights()[0], residual, self.bias)
