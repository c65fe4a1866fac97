"""Hypothesis state machine: random allocate / append / fork / free / reserve / attach
sequences keep the BlockManager's accounting exact."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.sequence import Sequence

NUM_BLOCKS = 12
BLOCK_SIZE = 4


class BlockManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")
    reservations = Bundle("reservations")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.live: list[Sequence] = []
        self.reserved: list[list[int]] = []

    @rule(target=seqs, length=st.integers(1, 3 * BLOCK_SIZE + 1))
    def allocate(self, length: int):
        s = Sequence(list(range(length)))
        free = self.bm.num_free_blocks
        if not self.bm.can_allocate(s):
            assert -(-length // BLOCK_SIZE) > free
            return s  # never admitted; other rules skip sequences without blocks
        self.bm.allocate(s)
        assert len(s.block_table) == -(-length // BLOCK_SIZE)
        assert self.bm.num_free_blocks == free - len(s.block_table)
        s.num_computed_tokens = length
        self.live.append(s)
        return s

    @rule(s=seqs, count=st.integers(1, 6))
    def append(self, s: Sequence, count: int):
        if s not in self.live:
            return
        for _ in range(count):
            s.append_token(7)
            if not self.bm.can_append(s):
                s.token_ids.pop()
                return
            self.bm.append_slot(s)
            s.num_computed_tokens = len(s)

    @rule(s=consumes(seqs))
    def free(self, s: Sequence):
        if s not in self.live:
            return
        self.bm.free(s)
        self.live.remove(s)

    @rule(target=seqs, parent=seqs, extra=st.integers(0, 5))
    def fork(self, parent: Sequence, extra: int):
        if parent not in self.live:
            return Sequence([0])
        shared = parent.num_computed_tokens
        child = Sequence(parent.token_ids[:shared] + [3] * extra)
        self.bm.fork(parent, child, shared)
        full = shared // BLOCK_SIZE
        if not self.bm.can_append(child):
            if child.block_table:
                self.bm.free(child)
            return child
        self.bm.append_slot(child)
        assert child.block_table[:full] == parent.block_table[:full]
        child.num_computed_tokens = len(child)
        self.live.append(child)
        return child

    @rule(target=reservations, n=st.integers(1, 4))
    def reserve(self, n: int):
        if not self.bm.can_reserve(n):
            return []
        blocks = self.bm.reserve(n)
        self.reserved.append(blocks)
        return blocks

    @rule(blocks=consumes(reservations))
    def release(self, blocks: list[int]):
        if blocks in self.reserved:
            self.bm.release(blocks)
            self.reserved.remove(blocks)

    @rule(target=seqs, blocks=consumes(reservations))
    def attach(self, blocks: list[int]):
        if blocks not in self.reserved:
            return Sequence([0])
        s = Sequence([*range(len(blocks) * BLOCK_SIZE), 5])
        s.num_computed_tokens = len(s) - 1
        self.bm.attach(s, blocks)
        self.reserved.remove(blocks)
        assert s.block_table == blocks
        self.live.append(s)
        if self.bm.can_append(s):
            self.bm.append_slot(s)
            assert len(s.block_table) == len(blocks) + 1
        return s

    @precondition(lambda self: self.live)
    @rule()
    def double_free_raises(self):
        victim = self.live[0]
        ghost = Sequence(victim.token_ids, seq_id="ghost")
        ghost.block_table = [b for b in range(NUM_BLOCKS) if self.bm.ref_count(b) == 0][:1]
        before = self.snapshot()
        if ghost.block_table:
            try:
                self.bm.free(ghost)
            except ValueError:
                pass
            else:
                raise AssertionError("freeing a free block must raise")
        assert self.snapshot() == before

    def snapshot(self):
        return (
            self.bm.num_free_blocks,
            [self.bm.ref_count(b) for b in range(NUM_BLOCKS)],
            [list(s.block_table) for s in self.live],
        )

    @invariant()
    def accounting_is_exact(self):
        holders = Counter(b for s in self.live for b in s.block_table)
        for blocks in self.reserved:
            holders.update(blocks)
        counts = [self.bm.ref_count(b) for b in range(NUM_BLOCKS)]
        assert counts == [holders[b] for b in range(NUM_BLOCKS)]
        free = sum(1 for c in counts if c == 0)
        assert self.bm.num_free_blocks == free
        assert self.bm.num_total_blocks == NUM_BLOCKS
        assert self.bm.num_reserved_blocks == sum(len(r) for r in self.reserved)

    @invariant()
    def tables_cover_their_tokens(self):
        for s in self.live:  # an attached arrival's last token may still lack its slot
            needed = self.bm.blocks_needed
            assert needed(s.num_computed_tokens) <= len(s.block_table) <= needed(len(s))
            assert len(set(s.block_table)) == len(s.block_table)

    @invariant()
    def only_forked_prefixes_are_shared(self):
        owners: dict[int, list[tuple[Sequence, int]]] = {}
        for s in self.live:
            for i, b in enumerate(s.block_table):
                owners.setdefault(b, []).append((s, i))
        for sharing in owners.values():
            if len(sharing) > 1:  # shared blocks are full and at the same logical index
                assert len({i for _, i in sharing}) == 1
                for s, i in sharing:
                    assert (i + 1) * BLOCK_SIZE <= len(s)

    def teardown(self):
        for s in list(self.live):
            self.bm.free(s)
        for blocks in self.reserved:
            self.bm.release(blocks)
        assert self.bm.num_free_blocks == NUM_BLOCKS
        assert all(self.bm.ref_count(b) == 0 for b in range(NUM_BLOCKS))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
