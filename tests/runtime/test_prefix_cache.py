"""The block manager's prefix cache: hits, the last token always computed, LRU eviction,
collisions that never hand out another prefix's K/V, and exact accounting under random
interleavings (Hypothesis)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bucketserve.runtime.core import block_hash
from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import Sequence

BS = 4


def computed(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence allocated and run to the end of its tokens."""
    seq = Sequence(tokens)
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    bm.cache_computed(seq)
    return seq


def test_a_shared_prefix_is_taken_from_the_cache_and_counts_as_computed():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    first = computed(bm, list(range(14)))  # 3 full blocks + 2 tokens
    second = Sequence([*range(12), 90, 91, 92])
    assert bm.num_cached_tokens(second) == 12
    bm.allocate(second)
    assert second.block_table[:3] == first.block_table[:3]
    assert second.num_computed_tokens == second.num_cached_tokens == 12
    assert [bm.ref_count(b) for b in second.block_table[:3]] == [2, 2, 2]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (14 + 15, 12)


def test_the_last_prompt_token_is_always_computed():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    computed(bm, list(range(8)))
    again = Sequence(list(range(8)))  # two full blocks, both cached
    bm.allocate(again)
    assert again.num_computed_tokens == 4  # the second block holds the last token


def test_off_means_no_hits_and_requests_for_prompt_logprobs_get_none():
    off = BlockManager(16, BS)
    computed(off, list(range(12)))
    assert off.num_cached_tokens(Sequence(list(range(12)))) == 0
    on = BlockManager(16, BS, enable_prefix_caching=True)
    computed(on, list(range(12)))
    wants = Sequence(list(range(12)), SamplingParams(prompt_logprobs=1))
    on.allocate(wants)
    assert wants.num_computed_tokens == 0


def test_freed_blocks_stay_cached_until_memory_is_needed_least_recent_first():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = computed(bm, list(range(8)))
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = Sequence([*range(4), 50, 51])
    bm.allocate(b)  # reuses a's first block, takes one never-used block
    assert b.num_computed_tokens == 4 and b.block_table[0] == a_blocks[0]
    bm.free(b)
    filler = Sequence(list(range(100, 116)))  # all four blocks: evicts every cached one
    bm.allocate(filler)
    assert bm.num_cached_blocks == 0
    bm.free(filler)
    late = Sequence(list(range(8)))
    bm.allocate(late)
    assert late.num_computed_tokens == 0


def test_a_hash_collision_never_hands_out_another_prefix(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(block_hash, "hash_block", lambda parent, tokens: 7)  # all collide
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = computed(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    other = Sequence([9, 9, 9, 9, 5, 6, 7, 8, 9])  # same hashes, other tokens
    bm.allocate(other)
    assert other.num_computed_tokens == 0
    assert not set(other.block_table) & set(a.block_table)
    same_start = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 0])  # first block truly shared
    bm.allocate(same_start)
    assert same_start.num_computed_tokens == 4  # the second block collides in its chain
    assert same_start.block_table[0] == a.block_table[0]
    assert same_start.block_table[1] != a.block_table[1]


def test_reserve_prefix_counts_the_blocks_that_need_no_transfer():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    src = computed(bm, list(range(14)))
    blocks, cached = bm.reserve_prefix([*range(12), 7, 7], 4)
    assert cached == 3 and blocks[:3] == src.block_table[:3]
    bm.release(blocks)
    bm.free(src)
    assert bm.num_free_blocks == 16


def test_a_prefix_being_computed_is_waited_for_not_computed_twice():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    first = Sequence(list(range(10)))
    bm.allocate(first)
    bm.cache_computed(first, 10)  # scheduled, its step not run yet
    second = Sequence([*range(8), 70, 71])
    assert bm.waits_for(second) and bm.num_cached_tokens(second) == 0
    first.num_computed_tokens = 10
    bm.cache_computed(first)  # the step ran
    assert not bm.waits_for(second) and bm.num_cached_tokens(second) == 8


def test_reset_forgets_every_cached_block():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    bm.free(computed(bm, list(range(9))))
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_tokens(Sequence(list(range(9)))) == 0


class PrefixCacheMachine(RuleBasedStateMachine):
    """Sequences over a two-token alphabet share prefixes often; whatever the interleaving
    of allocate / compute / fork / preempt / free / reserve, every block a table holds either
    is uncached or caches exactly the tokens that table has there, counts are exact, and
    after everything is freed every block is free."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(10, BS, enable_prefix_caching=True)
        self.live: list[Sequence] = []
        self.reservations: list[list[int]] = []

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=14))
    def allocate(self, tokens: list[int]):
        seq = Sequence(tokens)
        if not self.bm.can_allocate(seq):
            return
        self.bm.allocate(seq)
        hits = seq.block_table[: seq.num_computed_tokens // BS]
        assert not set(hits) & self.bm._pending  # never K/V a step has yet to write
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def schedule(self, data):
        """Its blocks named for a step that has not run yet (pending)."""
        seq = data.draw(st.sampled_from(self.live))
        self.bm.cache_computed(seq, len(seq))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.integers(0, 5))
    def compute(self, data, extra: int):
        seq = data.draw(st.sampled_from(self.live))
        for _ in range(extra):
            seq.append_token(1)
            if not self.bm.can_append(seq):
                seq.token_ids.pop()
                break
            self.bm.append_slot(seq)
        seq.num_computed_tokens = len(seq)
        self.bm.cache_computed(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = Sequence(parent.token_ids[: parent.num_computed_tokens] or [0])
        shared = parent.num_computed_tokens // BS * BS
        if shared == 0 or len(child) < shared:
            return
        self.bm.fork(parent, child, shared)
        child.num_computed_tokens = shared
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt_or_free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        self.live.remove(seq)

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12), n=st.integers(1, 4))
    def reserve(self, tokens: list[int], n: int):
        hits = self.bm._hits_of(tokens, [])[:n]
        # a hit no one holds sits in the free list (evictable): taking it costs a free block
        need = n - len(hits) + sum(1 for b in hits if self.bm._ref_counts[b] == 0)
        if need > self.bm.num_free_blocks:
            return
        blocks, cached = self.bm.reserve_prefix(tokens, n)
        assert 0 <= cached <= n and len(blocks) == n
        self.reservations.append(blocks)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def release(self, data):
        blocks = data.draw(st.sampled_from(self.reservations))
        self.reservations.remove(blocks)
        self.bm.release(blocks)

    @invariant()
    def cached_blocks_hold_their_tables_tokens(self):
        for seq in self.live:
            for i, block in enumerate(seq.block_table[: seq.num_computed_tokens // BS]):
                meta = self.bm._meta.get(block)
                if meta is not None:
                    assert meta[2] == tuple(seq.token_ids[i * BS : (i + 1) * BS])

    @invariant()
    def counts_are_exact(self):
        holders = Counter(b for s in self.live for b in s.block_table)
        holders.update(b for r in self.reservations for b in r)
        for block in range(self.bm.num_total_blocks):
            assert self.bm.ref_count(block) == holders[block]
        assert self.bm.num_free_blocks == sum(1 for b in range(10) if holders[b] == 0)

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq)
        for blocks in self.reservations:
            self.bm.release(blocks)
        assert self.bm.num_free_blocks == self.bm.num_total_blocks
        assert self.bm.num_reserved_blocks == 0


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
