"""Tensor-parallel linear layers over `Linear`'s packed GEMMs (Megatron's split, as vLLM
names it): column-parallel layers hold a slice of each output shard's rows and need no
communication; row-parallel ones hold a slice of the input columns and all-reduce their
partial products. Each rank's slice is cut from the checkpoint tensor at load
(`shard_tensor`), so the packing and the GEMM kernels see an ordinary, smaller weight."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bucketserve.runtime.cpu.gemm import linear, linear_add
from bucketserve.runtime.distributed.tp_group import TPGroup
from bucketserve.runtime.layers.linear import Linear


class ColumnParallelLinear(Linear):
    """Output shard i of this rank holds rows `sources[i] = (first, count)` of checkpoint
    tensor i (q, k, v; gate, up), weight and bias alike: for the rank's heads, or, where
    a model has fewer KV heads than ranks, a KV head it shares with other ranks."""

    def __init__(
        self,
        in_features: int,
        sources: Sequence[tuple[int, int]],
        bias: bool = False,
        gemm_parts: int = 1,
    ) -> None:
        super().__init__(in_features, [rows for _, rows in sources], bias, gemm_parts)
        self.sources = list(sources)

    def shard_tensor(self, leaf: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        return tensor.narrow(0, *self.sources[shard or 0])


class RowParallelLinear(Linear):
    """This rank's `in_features / size` input columns; its partial product is summed over
    the ranks with one all-reduce. The bias (and a fused residual) is added by rank 0
    alone, so the sum holds it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        if in_features % tp.size:
            raise ValueError(f"{in_features} input features do not split over {tp.size} ranks")
        super().__init__(in_features // tp.size, out_features, bias)
        self.tp = tp

    def shard_tensor(self, leaf: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        if leaf != "weight":
            return tensor
        return tensor.narrow(1, self.tp.rank * self.in_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        return self.tp.all_reduce(linear(x, self.gemm_weights()[0], bias))

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        weight = self.gemm_weights()[0]
        if self.tp.rank != 0:
            return self.tp.all_reduce(linear(x, weight))
        return self.tp.all_reduce(linear_add(x, weight, residual, self.bias))


def split_rows(total: int, tp: TPGroup) -> tuple[int, int]:
    """(first, count) of this rank's even share of `total` rows."""
    if total % tp.size:
        raise ValueError(f"{total} rows do not split evenly over {tp.size} ranks")
    count = total // tp.size
    return tp.rank * count, count


def kv_heads(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(first, count) of the KV heads this rank holds: an even share, or where there are
    fewer KV heads than ranks, the one head its block of `size / num_kv_heads` ranks
    shares (replicated, as vLLM does)."""
    if num_kv_heads >= tp.size:
        return split_rows(num_kv_heads, tp)
    if tp.size % num_kv_heads:
        raise ValueError(
            f"{num_kv_heads} KV heads neither split over nor replicate onto {tp.size} ranks"
        )
    return tp.rank * num_kv_heads // tp.size, 1
