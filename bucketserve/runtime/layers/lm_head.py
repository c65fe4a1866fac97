"""The LM head: logits of the rows a step samples."""

from __future__ import annotations

import torch
from torch import nn

from bucketserve.runtime.cpu.block_gemm import BlockGemm
from bucketserve.runtime.cpu.gemm import Weight, linear
from bucketserve.runtime.cpu.gemm_plan import GemmPlan
from bucketserve.runtime.distributed import tp_group
from bucketserve.runtime.io.quantized import QuantizedTensor
from bucketserve.runtime.layers.embedding import vocab_rows


class LMHead(nn.Module):
    """The `[vocab, hidden]` projection: its own weight, or with `tied` the embedding
    table. `pack` gives its GEMM a packed copy beside the plain weight (a tied table is
    read by the embedding's lookups too). `softcap` c: logits become `c * tanh(logits / c)`
    (Gemma's final logit softcapping). Built under a tensor-parallel group it is
    vocab-parallel, as the embedding: each rank projects onto its rows of the vocabulary
    and the ranks' logits are gathered. Its weight (or the tied table) may be kept in a
    GGUF's quantized blocks (`load_blocks`)."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        tied: nn.Embedding | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        self.softcap = softcap
        self.tp, self.vocab_size = tp_group.current(), vocab_size
        rows = vocab_size if self.tp is None else -(-vocab_size // self.tp.size)
        self.vocab_start = 0 if self.tp is None else self.tp.rank * rows
        if tied is None:
            self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self._tied = () if tied is None else (tied,)  # in a tuple: not registered twice
        self.packed: Weight | None = None

    @property
    def plain_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied else self.weight

    def shard_tensor(self, leaf: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        return vocab_rows(tensor, self.vocab_start, self.plain_weight.shape[0])

    def load_blocks(self, tensor: QuantizedTensor, shard: int | None) -> None:
        self.packed = BlockGemm(tensor)
        self.weight = nn.Parameter(self.weight.new_empty((0, self.weight.shape[1])), False)

    @property
    def gemm_weight(self) -> Weight:
        """What the GEMM reads: the packed copy, or the tied table's blocks, or the plain
        weight."""
        if self.packed is not None:
            return self.packed
        if self._tied and self._tied[0].blocks is not None:
            return self._tied[0].blocks
        return self.plain_weight

    def pack(self, plan: GemmPlan) -> None:
        weight = self.gemm_weight
        self.packed = plan.pack(weight, split_rows=False) if weight is self.plain_weight else weight

    def forward(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits `[len(rows), vocab]` of the given token rows of `hidden`."""
        logits = linear(hidden.index_select(0, rows), self.gemm_weight).float()
        if self.tp is not None:
            logits = self.tp.all_gather(logits)[:, : self.vocab_size]
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap
