"""Token and position embeddings."""

from __future__ import annotations

import torch
from torch import nn

from bucketserve.runtime.cpu.block_gemm import BlockGemm
from bucketserve.runtime.distributed import tp_group
from bucketserve.runtime.io.quantized import QuantizedTensor


class _LoadedEmbedding(nn.Embedding):
    """An embedding table the checkpoint fills: built on the meta device (`CausalLM.build`)
    it skips the random init, whose meta kernels import torch._dynamo (seconds a process)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class VocabEmbedding(_LoadedEmbedding):
    """The token table; with `scale` (Gemma: sqrt(hidden)) each looked-up row is multiplied
    by it, rounded to the model's dtype first as transformers does.

    Built under a tensor-parallel group, vocab-parallel: this rank holds rows
    `[vocab_start, vocab_start + num_embeddings)` of the table (the vocabulary padded to a
    multiple of the ranks, padding rows zero); a token another rank holds looks up zeros
    here and the ranks' rows are summed. The table may be kept in a GGUF's quantized blocks
    (`load_blocks`): a lookup expands its rows."""

    blocks: BlockGemm | None = None

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None) -> None:
        tp = tp_group.current()
        rows = vocab_size if tp is None else -(-vocab_size // tp.size)
        super().__init__(rows, hidden_size)
        self.tp, self.vocab_size = tp, vocab_size
        self.vocab_start = 0 if tp is None else tp.rank * rows
        self.scale_value = scale
        if scale is not None:
            self.register_buffer("scale", torch.tensor(scale), persistent=False)

    def reset(self) -> None:
        """Refill the scale (after `to_empty`), in the buffer's dtype: the model's."""
        if self.scale_value is not None:
            self.scale.fill_(self.scale_value)

    def shard_tensor(self, leaf: str, tensor: torch.Tensor, shard: int | None) -> torch.Tensor:
        return vocab_rows(tensor, self.vocab_start, self.num_embeddings)

    def load_blocks(self, tensor: QuantizedTensor, shard: int | None) -> None:
        if tensor.shape != tuple(self.weight.shape):
            raise ValueError(f"quantized table of shape {tensor.shape}, expected "
                             f"{tuple(self.weight.shape)}")
        self.blocks = BlockGemm(tensor)
        self.weight = nn.Parameter(self.weight.new_empty((0, self.embedding_dim)), False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            return self._parallel(input_ids)
        x = super().forward(input_ids) if self.blocks is None else self.blocks.rows(input_ids)
        return x if self.scale_value is None else x * self.scale

    def _parallel(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.num_embeddings)
        x = super().forward(local.masked_fill(elsewhere, 0))
        x = x.masked_fill(elsewhere.unsqueeze(-1), 0)
        if self.scale_value is not None:
            x = x * self.scale
        return self.tp.all_reduce(x)


def vocab_rows(tensor: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows `[start, start + rows)` of a `[vocab, ...]` checkpoint tensor, zeros past its end."""
    part = tensor[start : start + rows]
    if part.shape[0] == rows:
        return part
    pad = part.new_zeros((rows - part.shape[0], *part.shape[1:]))
    return torch.cat([part, pad])


class LearnedPositions(_LoadedEmbedding):
    """A learned table of `max_positions` rows, read at `position + offset` (OPT keeps its
    first `offset` rows unused)."""

    def __init__(self, max_positions: int, hidden_size: int, offset: int = 0) -> None:
        super().__init__(max_positions + offset, hidden_size)
        self.offset = offset

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(positions + self.offset)
