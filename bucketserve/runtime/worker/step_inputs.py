"""One step's model inputs from Sequences: token layout, block tables, slots, padding."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from numbers import Integral

import numpy as np
import torch

from bucketserve.runtime.attention.metadata import AttentionGroup, AttentionMetadata
from bucketserve.runtime.attention.unified import NOT_HELD
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.worker.prompt_logprobs import PromptSpan, span_rows

Shape = tuple[int, int, int]  # (batch, query_len, num_blocks)
# the unified strategy's (query tokens, shared blocks, unique blocks, is_causal)
UnifiedShape = tuple[int, int, int, int]


@dataclass
class StepInputs:
    """One step's device tensors; `logits_rows` picks each row's last new token."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_rows: torch.Tensor
    metadata: AttentionMetadata | None
    num_seqs: int
    write_slots: torch.Tensor | None = None  # padded steps: padding writes the null block
    flat: tuple[torch.Tensor, ...] | None = None  # a flat decode (or unified) step's graph args
    # a padded rectangle as the CPU's varlen kernel reads it: its real tokens first (token
    # order), their query_start_loc and each row's context length
    varlen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def graph_args(self) -> tuple[torch.Tensor, ...]:
        """A padded step's tensors, in `CompiledGraphs.step` (or `step_flat`) order."""
        if self.flat is not None:
            return self.flat
        assert self.metadata is not None
        assert self.varlen is not None
        group = self.metadata.groups[0]
        return (
            self.input_ids,
            self.positions,
            group.query_positions,
            self.write_slots,
            group.block_tables,
            *self.varlen,
            self.logits_rows,
        )


class InputBuilder:
    """Checks a step against the pool and lays it out: flat tokens, or with `pad_to=(B, Q,
    NB)` one `[B, Q]` rectangle whose padding tokens write nowhere, dummy rows filling the
    batch and block tables NB wide, so the step has exactly that shape."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        null_block: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.null_block = null_block
        self.max_model_len = max_model_len
        self.device = device

    def check_shape(self, shape: Sequence_[int]) -> Shape | UnifiedShape:
        if isinstance(shape, (tuple, list)) and len(shape) == 4:
            return self._check_unified(shape)
        ok = (
            isinstance(shape, (tuple, list))
            and len(shape) == 3
            and all(isinstance(x, Integral) and x >= 1 for x in shape)
        )
        if not ok:
            raise ValueError(
                f"shape must be (batch, query_len, num_blocks) of ints >= 1, got {shape!r}"
            )
        per_row = shape[2] // shape[0] if shape[1] == 1 else shape[2]  # decode: the total
        if per_row * self.block_size > self.max_model_len + self.block_size - 1:
            raise ValueError(
                f"shape {tuple(shape)} has more blocks than max_model_len {self.max_model_len}"
            )
        return (int(shape[0]), int(shape[1]), int(shape[2]))

    def _check_unified(self, shape: Sequence_[int]) -> UnifiedShape:
        ints = all(isinstance(x, Integral) and not isinstance(x, bool) for x in shape)
        if not ints or shape[0] < 1 or min(shape[1:3]) < 0 or shape[3] not in (0, 1):
            raise ValueError(
                "a unified shape is (query_len >= 1, shared_blocks >= 0, unique_blocks >= 0, "
                f"is_causal 0 or 1), got {shape!r}"
            )
        return (int(shape[0]), int(shape[1]), int(shape[2]), int(shape[3]))

    def unified_need(self, seqs: list[Sequence], num_new_tokens: list[int]) -> UnifiedShape:
        """The unified shape a step fills exactly (`bucket_manager.unified_need`'s rules)."""
        return _Context(seqs, num_new_tokens, self.block_size).need

    def build_unified(
        self, seqs: list[Sequence], num_new_tokens: list[int], pad_to: UnifiedShape
    ) -> StepInputs:
        """A validated step at `pad_to = (T, S, U, causal)`: its new tokens flat, then
        padding tokens (written to the null block, each seeing itself alone); the shared
        context blocks with, per token, where its row holds each (`shared_starts`); the
        unique ones with the token that reads each; every row's last token for logits."""
        ctx = _Context(seqs, num_new_tokens, self.block_size)
        if any(have < want for have, want in zip(pad_to, ctx.need, strict=True)):
            raise ValueError(f"pad_to {pad_to} is smaller than the step {ctx.need}")
        tokens, num_shared, num_unique, _ = pad_to
        b = _Batch(seqs, num_new_tokens, self.block_size)
        bs, n = self.block_size, len(b.pos)
        tables = np.full((b.n, int(b.nblocks.max(initial=0))), self.null_block, dtype=np.int64)
        for i, seq in enumerate(seqs):
            tables[i, : b.nblocks[i]] = seq.block_table[: b.nblocks[i]]
        input_ids = np.zeros(tokens, dtype=np.int64)
        input_ids[:n] = b.token_ids()
        positions = np.zeros(tokens, dtype=np.int64)
        positions[:n] = b.pos
        slots = np.full(tokens, self.null_block * bs, dtype=np.int64)
        slots[:n] = tables[b.seq_idx, b.pos // bs] * bs + b.pos % bs
        token_rows = np.full(tokens, -1, dtype=np.int64)
        token_rows[:n] = b.seq_idx
        context_ends = np.zeros(tokens, dtype=np.int64)
        context_ends[:n] = b.starts[b.seq_idx]

        shared = np.isin(ctx.blocks, ctx.shared)
        at = np.searchsorted(ctx.shared, ctx.blocks[shared])
        row_starts = np.full((b.n, num_shared), NOT_HELD, dtype=np.int64)
        row_starts[ctx.rows[shared], at] = ctx.indices[shared] * bs
        shared_blocks = np.full(num_shared, self.null_block, dtype=np.int64)
        shared_blocks[: len(ctx.shared)] = ctx.shared
        shared_starts = np.full((tokens, num_shared), NOT_HELD, dtype=np.int64)
        shared_starts[:n] = row_starts[b.seq_idx]
        first_token = np.cumsum(b.qlens) - b.qlens
        at = np.searchsorted(ctx.unique, ctx.blocks[~shared])
        unique_blocks = np.full(num_unique, self.null_block, dtype=np.int64)
        unique_blocks[: len(ctx.unique)] = ctx.unique
        unique_owners = np.zeros(num_unique, dtype=np.int64)
        unique_owners[at] = first_token[ctx.rows[~shared]]  # a unique block's row: 1 token
        unique_starts = np.full(num_unique, NOT_HELD, dtype=np.int64)
        unique_starts[at] = ctx.indices[~shared] * bs
        t = self.to_device
        arrays = (
            input_ids, positions, slots, token_rows, context_ends, shared_blocks, shared_starts,
            unique_blocks, unique_owners, unique_starts,
        )  # fmt: skip
        flat = tuple(t(a) for a in arrays)
        rows = t(first_token + b.qlens - 1)
        return StepInputs(flat[0], flat[1], rows, None, b.n, flat[2], flat)

    def need(self, seqs: list[Sequence], num_new_tokens: list[int]) -> Shape:
        """The unpadded shape of a step: rows, longest chunk, widest block table (a decode
        step: the batch's total blocks)."""
        ends = [s.num_computed_tokens + n for s, n in zip(seqs, num_new_tokens, strict=True)]
        blocks = [-(-e // self.block_size) for e in ends]
        if max(num_new_tokens) == 1:
            return (len(seqs), 1, sum(blocks))
        return (len(seqs), max(num_new_tokens), max(blocks))

    def validate(
        self, seqs: list[Sequence], num_new_tokens: list[int], padded: bool = True
    ) -> None:
        """ValueError naming what is wrong with a step; no rows at all only when `padded`
        (warm-up runs a shape on dummy rows)."""
        if not seqs and not padded:
            raise ValueError("execute needs at least one sequence")
        if len(seqs) != len(num_new_tokens):
            raise ValueError(f"{len(seqs)} sequences but {len(num_new_tokens)} num_new_tokens")
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            if not isinstance(n, Integral) or not 1 <= n <= len(seq) - start:
                raise ValueError(
                    f"seq {seq.seq_id}: num_new_tokens {n!r} must be in [1, {len(seq) - start}]"
                )
            end = start + n
            if end > self.max_model_len:
                raise ValueError(
                    f"seq {seq.seq_id}: {end} tokens exceed max_model_len {self.max_model_len}"
                )
            needed = -(-end // self.block_size)
            table = seq.block_table[:needed]
            if len(table) < needed:
                raise ValueError(
                    f"seq {seq.seq_id}: block_table has {len(seq.block_table)} blocks, "
                    f"{needed} are needed for {end} tokens"
                )
            if any(not 0 <= b < self.num_blocks for b in table):
                raise ValueError(
                    f"seq {seq.seq_id}: block ids must be in [0, {self.num_blocks})"
                )

    def build(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: Shape | None,
        spans: list[PromptSpan] | None = None,
    ) -> StepInputs:
        """Device tensors for a step its caller has validated (`validate`); the logits rows
        of prompt-logprob `spans` follow the sequences' own."""
        b = _Batch(seqs, num_new_tokens, self.block_size)
        rows, max_q, max_blocks = b.n, int(b.qlens.max(initial=1)), int(b.nblocks.max(initial=1))
        if pad_to is not None:
            if pad_to[0] < rows or pad_to[1] < max_q or pad_to[2] < max_blocks:
                raise ValueError(
                    f"pad_to {pad_to} is smaller than the step (batch {rows}, "
                    f"query_len {max_q}, num_blocks {max_blocks})"
                )
            rows, max_q, max_blocks = pad_to
        # Prompt chunks with no earlier context attend to themselves alone (not in a graph).
        fresh = (b.starts == 0) & (b.qlens > 1) & (pad_to is None)
        rectangular = pad_to is not None or bool((b.qlens == max_q).all() and not fresh.any())
        qlens = np.zeros(rows, dtype=np.int64)
        qlens[: b.n] = b.qlens
        row_start = np.arange(rows) * max_q if rectangular else np.cumsum(qlens) - qlens
        num_tokens = rows * max_q if rectangular else int(b.qlens.sum())
        flat = row_start[b.seq_idx] + b.within

        tables = np.full((rows, max_blocks), self.null_block, dtype=np.int64)
        for i, seq in enumerate(seqs):
            tables[i, : b.nblocks[i]] = seq.block_table[: b.nblocks[i]]
        input_ids = np.zeros(num_tokens, dtype=np.int64)
        input_ids[flat] = b.token_ids()
        positions = np.zeros(num_tokens, dtype=np.int64)
        positions[flat] = b.pos
        slots = np.full(num_tokens, -1, dtype=np.int64)
        slots[flat] = tables[b.seq_idx, b.pos // self.block_size] * self.block_size
        slots[flat] += b.pos % self.block_size
        context_lens = np.zeros(rows, dtype=np.int32)
        context_lens[: b.n] = b.starts + b.qlens
        query_start_loc = np.append(row_start, num_tokens).astype(np.int32)
        logits_rows = row_start + np.maximum(qlens - 1, 0)
        if spans:
            logits_rows = np.concatenate([logits_rows, span_rows(spans, row_start)])

        t = self.to_device
        if rectangular:
            qpos = np.zeros((rows, max_q), dtype=np.int64)
            qpos[b.seq_idx, b.within] = b.pos
            groups = [AttentionGroup(t(tables), t(qpos))]
        else:
            groups = [
                self._group(b, rows_in, tables, row_start, flat)
                for rows_in in _split_rows(b.qlens, ~fresh)
            ]
        metadata = AttentionMetadata(
            slot_mapping=t(slots),
            query_start_loc=t(query_start_loc),
            context_lens=t(context_lens),
            block_tables=t(tables),
            block_size=self.block_size,
            null_block=self.null_block,
            groups=groups,
            padded=pad_to is not None,
        )
        metadata.causal_spans = [
            (int(row_start[i]), int(row_start[i] + b.qlens[i])) for i in np.flatnonzero(fresh)
        ]
        write = varlen = None
        if pad_to is not None:
            write = t(np.where(slots >= 0, slots, self.null_block * self.block_size))
            padding = np.setdiff1d(np.arange(num_tokens), flat, assume_unique=True)
            compact = np.append(0, np.cumsum(qlens)).astype(np.int32)
            varlen = (t(np.concatenate([flat, padding])), t(compact), t(context_lens))
        return StepInputs(
            t(input_ids), t(positions), t(logits_rows), metadata, b.n, write, varlen=varlen
        )

    def build_flat(
        self, seqs: list[Sequence], num_new_tokens: list[int], pad_to: Shape
    ) -> StepInputs:
        """A validated decode step at `pad_to = (B, 1, NB)`, NB the batch's total blocks as
        vllm-gaudi counts them: the flat list of every row's blocks, each with its row and
        the slots that hold context (`attend_flat`), and each row's first block in the list
        and its context length (the CPU kernel's view of the same list)."""
        if any(n != 1 for n in num_new_tokens):
            raise ValueError("a decode shape (batch, 1, blocks) takes one new token per row")
        b = _Batch(seqs, num_new_tokens, self.block_size)
        rows, _, total = pad_to
        if rows < b.n or total < int(b.nblocks.sum()):
            raise ValueError(
                f"pad_to {pad_to} is smaller than the step (batch {b.n}, "
                f"{int(b.nblocks.sum())} blocks in all)"
            )
        bs = self.block_size
        block_list = np.full(total, self.null_block, dtype=np.int64)
        block_rows = np.zeros(total, dtype=np.int64)
        valid = np.zeros((total, bs), dtype=bool)
        starts = np.zeros(rows, dtype=np.int64)
        context_lens = np.zeros(rows, dtype=np.int32)
        slots = np.full(rows, self.null_block * bs, dtype=np.int64)
        at = 0
        for i, seq in enumerate(seqs):
            n, pos = int(b.nblocks[i]), int(b.pos[i])
            block_list[at : at + n] = seq.block_table[:n]
            block_rows[at : at + n] = i
            valid[at : at + n] = (np.arange(n * bs) <= pos).reshape(n, bs)
            slots[i] = seq.block_table[pos // bs] * bs + pos % bs
            starts[i], context_lens[i] = at, pos + 1
            at += n
        input_ids = np.zeros(rows, dtype=np.int64)
        input_ids[: b.n] = b.token_ids()
        positions = np.zeros(rows, dtype=np.int64)
        positions[: b.n] = b.pos
        t = self.to_device
        arrays = (
            input_ids, positions, slots, block_list, block_rows, valid, starts, context_lens,
            np.arange(rows),
        )  # fmt: skip
        flat = tuple(t(a) for a in arrays)
        return StepInputs(flat[0], flat[1], flat[-1], None, b.n, flat[2], flat)

    def _group(
        self,
        b: _Batch,
        rows: np.ndarray,
        tables: np.ndarray,
        row_start: np.ndarray,
        flat: np.ndarray,
    ) -> AttentionGroup:
        """An AttentionGroup for some rows of a flat (non-rectangular) step."""
        qlens = b.qlens[rows]
        max_q, max_blocks = int(qlens.max()), int(b.nblocks[rows].max())
        local = np.full(b.n, -1, dtype=np.int64)
        local[rows] = np.arange(len(rows))
        mine = local[b.seq_idx] >= 0
        slot = local[b.seq_idx[mine]] * max_q + b.within[mine]
        qpos = np.zeros(len(rows) * max_q, dtype=np.int64)
        qpos[slot] = b.pos[mine]
        last = np.maximum(qlens - 1, 0)[:, None]
        gather = row_start[rows][:, None] + np.minimum(np.arange(max_q), last)
        t = self.to_device
        full = bool((qlens == max_q).all())
        return AttentionGroup(
            block_tables=t(tables[rows, :max_blocks]),
            query_positions=t(qpos.reshape(len(rows), max_q)),
            gather_index=t(gather.reshape(-1)),
            valid_slots=None if full else t(slot),
            tokens=t(gather.reshape(-1) if full else flat[mine]),
        )

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)


class _Context:
    """A step's context blocks (those holding a row's tokens before the step): per (row,
    block index) pair its block, and the blocks two or more of the step's tokens read
    (`shared`) or one does (`unique`), each sorted."""

    def __init__(self, seqs: list[Sequence], num_new_tokens: list[int], block_size: int):
        rows, indices, blocks = [], [], []
        for i, seq in enumerate(seqs):
            held = -(-seq.num_computed_tokens // block_size)
            rows.extend([i] * held)
            indices.extend(range(held))
            blocks.extend(seq.block_table[:held])
        self.rows = np.asarray(rows, dtype=np.int64)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.blocks = np.asarray(blocks, dtype=np.int64)
        counts = np.asarray(num_new_tokens, dtype=np.int64)
        ids, where = np.unique(self.blocks, return_inverse=True)
        readers = np.bincount(where, weights=counts[self.rows], minlength=len(ids))
        self.shared = ids[readers > 1]
        self.unique = ids[readers == 1]
        causal = int(counts.max(initial=1) > 1)
        self.need = (int(counts.sum()), len(self.shared), len(self.unique), causal)


class _Batch:
    """Per-token bookkeeping of a step's real sequences (numpy, host side)."""

    def __init__(self, seqs: list[Sequence], num_new_tokens: list[int], block_size: int) -> None:
        self.seqs = seqs
        self.n = len(seqs)
        self.qlens = np.asarray(num_new_tokens, dtype=np.int64)
        self.starts = np.asarray([s.num_computed_tokens for s in seqs], dtype=np.int64)
        self.nblocks = -(-(self.starts + self.qlens) // block_size)
        self.seq_idx = np.repeat(np.arange(self.n), self.qlens)
        self.within = np.arange(len(self.seq_idx)) - np.repeat(
            np.cumsum(self.qlens) - self.qlens, self.qlens
        )
        self.pos = self.starts[self.seq_idx] + self.within

    def token_ids(self) -> np.ndarray:
        chunks = (
            s.token_ids[a : a + q]
            for s, a, q in zip(self.seqs, self.starts.tolist(), self.qlens.tolist(), strict=True)
        )
        return np.fromiter(
            itertools.chain.from_iterable(chunks), dtype=np.int64, count=len(self.pos)
        )


def _split_rows(qlens: np.ndarray, paged: np.ndarray) -> list[np.ndarray]:
    """The `paged` rows in groups: decode rows (one new token) apart from prefill rows, so
    neither pads to the other."""
    decode = qlens == 1
    groups = (np.flatnonzero(paged & decode), np.flatnonzero(paged & ~decode))
    return [rows for rows in groups if len(rows)]
