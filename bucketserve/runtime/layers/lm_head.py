"""The LM head: logits of the rows a step samples."""

from __future__ import annotations

import torch
from torch import nn

from bucketserve.runtime.cpu.gemm import Weight, linear
from bucketserve.runtime.cpu.gemm_plan import GemmPlan


class LMHead(nn.Module):
    """The `[vocab, hidden]` projection: its own weight, or with `tied` the embedding
    table. `pack` gives its GEMM a packed copy beside the plain weight (a tied table is
    read by the embedding's lookups too)."""

    def __init__(self, hidden_size: int, vocab_size: int, tied: nn.Embedding | None = None):
        super().__init__()
        if tied is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self._tied = () if tied is None else (tied,)  # in a tuple: not registered twice
        self.packed: Weight | None = None

    @property
    def plain_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied else self.weight

    def pack(self, plan: GemmPlan) -> None:
        self.packed = plan.pack(self.plain_weight, split_rows=False)

    def forward(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits `[len(rows), vocab]` of the given token rows of `hidden`."""
        weight = self.plain_weight if self.packed is None else self.packed
        return linear(hidden.index_select(0, rows), weight).float()
