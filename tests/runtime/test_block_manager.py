"""BlockManager: allocation, growth, refcounted sharing, reservations, and bad input."""

from __future__ import annotations

import pytest

from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.sequence import Sequence


def seq(n: int) -> Sequence:
    return Sequence(list(range(1, n + 1)))


def test_allocate_covers_tokens_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(5), seq(4)
    assert bm.can_allocate(a)
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert bm.num_free_blocks == 5
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 7
    c = seq(12)
    bm.allocate(c)  # the freed 0 and 1 went to the back of the free list
    assert c.block_table == [3, 4, 5] and bm.num_free_blocks == 4


def test_append_slot_grows_only_across_a_block_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(3)
    bm.allocate(s)
    tables = []
    for token in range(6):
        s.append_token(100 + token)
        assert bm.can_append(s)
        bm.append_slot(s)
        tables.append(len(s.block_table))
    assert tables == [1, 2, 2, 2, 2, 3]  # lengths 4..9 need 1, 2, 2, 2, 2, 3 blocks
    assert bm.num_free_blocks == 1


def test_can_append_false_when_pool_is_exhausted():
    bm = BlockManager(num_blocks=2, block_size=2)
    s = seq(4)
    bm.allocate(s)
    s.append_token(9)
    assert not bm.can_append(s)
    with pytest.raises(ValueError, match="needs 1 more blocks, 0 are free"):
        bm.append_slot(s)
    assert s.block_table == [0, 1] and bm.num_free_blocks == 0


def test_allocate_rejects_a_pool_too_small_without_changing_state():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(9)
    assert not bm.can_allocate(s)
    with pytest.raises(ValueError, match="needs 3 more blocks"):
        bm.allocate(s)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_double_free_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(6)
    bm.allocate(s)
    bm.free(s)
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.free(s)
    stale = seq(2)
    stale.block_table = [0, 1]  # blocks it never got
    with pytest.raises(ValueError, match="not allocated"):
        bm.free(stale)
    assert bm.num_free_blocks == 4 and stale.block_table == [0, 1]


def test_fork_shares_full_blocks_until_the_last_holder_frees():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(10)
    bm.allocate(parent)
    parent.num_computed_tokens = 10
    child = Sequence([*parent.token_ids[:9], 77, 78])
    bm.fork(parent, child, 9)  # two full blocks (8 tokens) are shareable
    assert child.block_table == parent.block_table[:2]
    assert [bm.ref_count(b) for b in parent.block_table] == [2, 2, 1]
    bm.append_slot(child)  # 11 tokens need a third block of its own
    assert child.block_table[2] not in parent.block_table
    bm.free(parent)
    assert bm.num_free_blocks == 8 - 3  # the shared two stay with the child
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_fork_rejects_a_different_prefix():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(8)
    bm.allocate(parent)
    parent.num_computed_tokens = 8
    with pytest.raises(ValueError, match="shared prefix"):
        bm.fork(parent, Sequence([9] * 8), 8)
    with pytest.raises(ValueError, match="at most 8"):
        bm.fork(parent, seq(12), 12)
    assert [bm.ref_count(b) for b in parent.block_table] == [1, 1]


def test_reserve_attach_and_release():
    bm = BlockManager(num_blocks=6, block_size=4)
    held = bm.reserve(3)
    assert held == [0, 1, 2] and bm.num_free_blocks == 3 and bm.num_reserved_blocks == 3
    arrived = seq(9)  # 8 prompt tokens + a first token sampled by the prefill worker
    arrived.num_computed_tokens = 8
    bm.attach(arrived, held[:2])
    assert arrived.block_table == [0, 1] and bm.num_reserved_blocks == 1
    bm.append_slot(arrived)  # the 9th token's slot
    assert len(arrived.block_table) == 3
    bm.release([2])
    bm.free(arrived)
    assert bm.num_free_blocks == 6 and bm.num_reserved_blocks == 0


def test_reservation_misuse_is_rejected():
    bm = BlockManager(num_blocks=4, block_size=4)
    held = bm.reserve(2)
    with pytest.raises(ValueError, match="cannot reserve 3 blocks: 2 are free"):
        bm.reserve(3)
    with pytest.raises(ValueError, match="positive integer"):
        bm.reserve(0)
    with pytest.raises(ValueError, match=r"blocks \[3\] are not reserved"):
        bm.release([3])
    with pytest.raises(ValueError, match="without repeats"):
        bm.release([held[0], held[0]])
    short = seq(9)
    short.num_computed_tokens = 8
    with pytest.raises(ValueError, match="needs 2 to 3 blocks, got 1"):
        bm.attach(short, held[:1])
    assert bm.num_reserved_blocks == 2 and bm.num_free_blocks == 2 and short.block_table == []
    bm.release(held)
    with pytest.raises(ValueError, match="not reserved"):
        bm.release(held)
    assert bm.num_free_blocks == 4


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (2.0, 4)])
def test_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError, match="positive integer"):
        BlockManager(num_blocks, block_size)
