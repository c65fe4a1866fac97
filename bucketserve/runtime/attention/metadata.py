"""Paged attention's per-step metadata: where a step's tokens live in the pool and how its
rows are attended (the C kernels' varlen or decode call, or padded rectangles)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bucketserve.runtime.cpu import kernels


@dataclass
class AttentionGroup:
    """Rows of the step attended together as one `[R, Q]` padded rectangle.

    `query_positions[r, i]` is the position of row r's i-th new token (0 for
    padding), so that query sees keys 0..query_positions[r, i] through
    `block_tables[r]`. `gather_index[s]` is the flat token of padded slot s
    (None: the step's tokens already are this rectangle); `tokens[j]` is the
    flat token of padded slot `valid_slots[j]` (valid_slots None: every slot).
    """

    block_tables: torch.Tensor  # [R, NB] long, padded with the null block
    query_positions: torch.Tensor  # [R, Q] long
    gather_index: torch.Tensor | None = None  # [R * Q] long
    valid_slots: torch.Tensor | None = None  # [n] long
    tokens: torch.Tensor | None = None  # [n] long
    attn_mask: torch.Tensor | None = None  # set by prepare() for the rectangle path
    context_lens: torch.Tensor | None = None  # [R] int32, set by prepare() for the kernel
    # attn_mask narrowed to a sliding window, per window (layers may differ), made once a step
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def prepare(
        self, block_size: int, num_queries_per_kv: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        """One query per row on a CPU with the C kernel: it reads the pool in place;
        otherwise the rectangle's mask for the gather + SDPA path."""
        kernel = kernels.for_tensors(dtype, self.query_positions.device)
        if (
            self.query_positions.shape[1] == 1
            and kernel
            and kernel.supports(head_dim, num_queries_per_kv, block_size)
        ):
            self.context_lens = (self.query_positions[:, 0] + 1).to(torch.int32)
            self.block_tables = self.block_tables.contiguous()
            return
        num_keys = self.block_tables.shape[1] * block_size
        self.attn_mask = rect_mask(self.query_positions, num_keys, num_queries_per_kv, dtype)

    def window_mask(self, sliding_window: int) -> torch.Tensor:
        """The rectangle's mask with each query seeing its last `sliding_window` keys alone."""
        mask = self.window_masks.get(sliding_window)
        if mask is None:
            assert self.attn_mask is not None
            _, _, rows, num_keys = self.attn_mask.shape
            per_kv = rows // self.query_positions.shape[1]
            mask = rect_mask(
                self.query_positions, num_keys, per_kv, self.attn_mask.dtype, sliding_window
            )
            self.window_masks[sliding_window] = mask
        return mask


def rect_mask(
    query_positions: torch.Tensor,
    num_keys: int,
    num_queries_per_kv: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The additive mask `[R, 1, per_kv * Q, keys]` of a padded rectangle: query i of row r
    at position p = query_positions[r, i] sees keys 0..p, or with a sliding window w the
    keys p - w + 1..p (transformers' sliding-window semantics)."""
    keys = torch.arange(num_keys, device=query_positions.device)
    # Row order matches the query layout in attend_rect: group-major.
    positions = query_positions.repeat(1, num_queries_per_kv).unsqueeze(-1)
    allowed = keys <= positions
    if sliding_window:
        allowed = allowed & (keys > positions - sliding_window)
    allowed = allowed.unsqueeze(1)
    # Additive float mask: SDPA's CPU kernel is faster with it than with a bool one.
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, float("-inf"))


@dataclass
class AttentionMetadata:
    """Where one step's tokens live in the pool; built once per step, shared by all layers.

    Flat token t is written to pool slot `slot_mapping[t]` (block *
    block_size + offset; -1 = padding, written nowhere). The per-sequence
    fields (query_start_loc, context_lens, block_tables) describe the step
    for a fused varlen kernel, which a CPU with the C kernels runs on any step
    with prompt chunks (`varlen`, when the step is not `padded` to a shape
    bucket). Without it the torch path splits the step in two: `causal_spans`,
    the flat token ranges `[start, end)` of prompt chunks with no earlier
    context, which attend causally to their own new K/V (nothing read back
    from the pool, no mask), and `groups`, the other rows by similar query
    length, each one padded rectangle read through the block table.
    """

    slot_mapping: torch.Tensor  # [T] long
    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32, tokens in context after this step
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with the null block
    block_size: int
    null_block: int
    groups: list[AttentionGroup] = field(default_factory=list)
    causal_spans: list[tuple[int, int]] = field(default_factory=list)
    padded: bool = False  # rows and queries padded to a shape bucket
    write_slots: torch.Tensor | None = None  # set by prepare()
    varlen: bool = False  # set by prepare(): the C varlen kernel attends the whole step
    # causal masks of sliding windows over a prompt chunk, per (length, window, dtype)
    span_masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(
        default_factory=dict, repr=False
    )

    def span_mask(self, length: int, sliding_window: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive `[length, length]` mask of a prompt chunk with no earlier context
        under a sliding window: token i sees tokens i - w + 1..i."""
        key = (length, sliding_window, dtype)
        mask = self.span_masks.get(key)
        if mask is None:
            at = torch.arange(length, device=self.slot_mapping.device)
            back = at.unsqueeze(1) - at
            allowed = (back >= 0) & (back < sliding_window)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            mask = mask.masked_fill(~allowed, float("-inf"))
            self.span_masks[key] = mask
        return mask

    def prepare(self, num_queries_per_kv: int, head_dim: int, dtype: torch.dtype) -> None:
        """Derive what the CPU path needs, once per step (graph-capturable: no host sync)."""
        null_slot = self.null_block * self.block_size
        self.write_slots = torch.where(self.slot_mapping >= 0, self.slot_mapping, null_slot)
        kernel = kernels.for_tensors(dtype, self.slot_mapping.device)
        decode_only = (
            len(self.groups) == 1
            and not self.causal_spans
            and self.groups[0].query_positions.shape[1] == 1
        )
        if (
            kernel
            and not self.padded
            and not decode_only
            and kernel.supports(head_dim, num_queries_per_kv, self.block_size)
        ):
            self.varlen = True
            return
        for group in self.groups:
            group.prepare(self.block_size, num_queries_per_kv, head_dim, dtype)
