"""Paged KV block allocation and per-sequence block tables (torch-free)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from bucketserve.runtime.core.sequence import Sequence


class BlockManager:
    """Hands out fixed-size KV blocks from a free list and keeps `seq.block_table`.

    Every block has a reference count: a block sits in the free list exactly
    when its count is 0, so blocks shared between tables (a forked prefix)
    are freed by their last holder. Blocks can also be reserved with no
    sequence yet — the landing place of an incoming KV transfer — and later
    attached to the sequence that arrives already prefilled.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._reserved: set[int] = set()

    @property
    def num_total_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_reserved_blocks(self) -> int:
        return len(self._reserved)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- sequences ---------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(len(seq)) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """A fresh table covering every token of `seq`."""
        if seq.block_table:
            raise ValueError(f"seq {seq.seq_id} already holds {len(seq.block_table)} blocks")
        self._grow(seq, self.blocks_needed(len(seq)))

    def can_append(self, seq: Sequence) -> bool:
        return self._shortfall(seq) <= len(self._free)

    def append_slot(self, seq: Sequence) -> None:
        """Grow the table so it covers every token of `seq`, including the one just appended."""
        self._grow(seq, self._shortfall(seq))

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody else holds go back to the free list."""
        if not seq.block_table:
            raise ValueError(f"seq {seq.seq_id} holds no blocks (freed twice?)")
        self._check_live(seq.block_table, f"seq {seq.seq_id}")
        self._decref(seq.block_table)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """Share the parent's full blocks holding its first `num_tokens` tokens with `child`,
        whose table must be empty and whose tokens must start with those same tokens."""
        num_blocks = num_tokens // self.block_size
        if child.block_table:
            raise ValueError(f"seq {child.seq_id} already holds blocks; fork needs an empty table")
        if not 0 <= num_tokens <= min(parent.num_computed_tokens, len(child)):
            raise ValueError(
                f"can share at most {min(parent.num_computed_tokens, len(child))} tokens, "
                f"got {num_tokens}"
            )
        if parent.token_ids[:num_tokens] != child.token_ids[:num_tokens]:
            raise ValueError("child's tokens do not start with the shared prefix")
        shared = parent.block_table[:num_blocks]
        for block in shared:
            self._ref_counts[block] += 1
        child.block_table = list(shared)

    # -- reservations (incoming KV transfers) ------------------------------------------------

    def can_reserve(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def reserve(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks for a transfer that has no sequence yet."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if num_blocks > len(self._free):
            raise ValueError(f"cannot reserve {num_blocks} blocks: {len(self._free)} are free")
        blocks = self._take(num_blocks)
        self._reserved.update(blocks)
        return blocks

    def release(self, block_ids: Iterable[int]) -> None:
        """Give back reserved blocks whose transfer will not be attached."""
        blocks = self._check_reserved(block_ids)
        self._reserved.difference_update(blocks)
        self._decref(blocks)

    def attach(self, seq: Sequence, block_ids: Iterable[int]) -> None:
        """Make reserved blocks the table of `seq`, whose first `num_computed_tokens` tokens
        already have their K/V in them."""
        blocks = self._check_reserved(block_ids)
        if seq.block_table:
            raise ValueError(f"seq {seq.seq_id} already holds blocks")
        needed = self.blocks_needed(seq.num_computed_tokens)
        if not needed <= len(blocks) <= self.blocks_needed(len(seq)):
            raise ValueError(
                f"seq {seq.seq_id} with {seq.num_computed_tokens} computed of {len(seq)} tokens "
                f"needs {needed} to {self.blocks_needed(len(seq))} blocks, got {len(blocks)}"
            )
        self._reserved.difference_update(blocks)
        seq.block_table = blocks

    # -- internals ---------------------------------------------------------------------------

    def _shortfall(self, seq: Sequence) -> int:
        return max(0, self.blocks_needed(len(seq)) - len(seq.block_table))

    def _grow(self, seq: Sequence, num_blocks: int) -> None:
        if num_blocks > len(self._free):
            raise ValueError(
                f"seq {seq.seq_id} needs {num_blocks} more blocks, {len(self._free)} are free"
            )
        seq.block_table.extend(self._take(num_blocks))

    def _take(self, num_blocks: int) -> list[int]:
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def _decref(self, blocks: list[int]) -> None:
        for block in blocks:
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def _check_live(self, blocks: list[int], owner: str) -> None:
        counts: dict[int, int] = {}
        for block in blocks:
            counts[block] = counts.get(block, 0) + 1
        for block, n in counts.items():
            if not 0 <= block < len(self._ref_counts) or self._ref_counts[block] < n:
                raise ValueError(f"{owner}: block {block} is not allocated (double free?)")

    def _check_reserved(self, block_ids: Iterable[int]) -> list[int]:
        blocks = list(block_ids)
        if not blocks or len(set(blocks)) != len(blocks):
            raise ValueError(f"block ids must be a non-empty list without repeats, got {blocks}")
        stray = [b for b in blocks if b not in self._reserved]
        if stray:
            raise ValueError(f"blocks {stray} are not reserved")
        return blocks
