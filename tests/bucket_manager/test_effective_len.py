"""BucketServe over effective lengths: with a cached prefix expected, a request is bucketed,
ordered, budgeted and padded by the tokens it computes, while its KV blocks still count the
whole prompt."""

import pytest

from bucketserve.bucket_manager import (
    BatchingConfig,
    BucketManager,
    BucketManagerConfig,
    BucketRange,
    PromptShapeConfig,
    RequestBucketConfig,
    ShapeBucketConfig,
    TenantConfig,
)
from bucketserve.bucket_manager.batching_controller import BatchingController
from tests.bucket_manager.helpers import ids, make_manager, req

SJF = TenantConfig(name="batch", tenant_class="offline", policy="sjf", max_wait_s=None)
LJF = TenantConfig(name="batch", tenant_class="offline", policy="ljf", max_wait_s=None)


def test_the_effective_length_is_the_prompt_less_its_cached_prefix():
    r = req(1, 1000, cached_len=896, max_tokens=24)
    assert (r.effective_len, r.expected_work, r.expected_len) == (104, 128, 1024)
    assert req(2, 10).effective_len == 10
    with pytest.raises(ValueError, match="at least one of the 10 prompt tokens"):
        req(3, 10, cached_len=10)
    with pytest.raises(ValueError, match="cached_len must be an integer >= 0"):
        req(4, 10, cached_len=-1)


@pytest.mark.parametrize("tenant", [SJF, LJF])
def test_sjf_and_ljf_order_by_the_tokens_a_request_computes(tenant):
    manager = make_manager(tenant, max_num_seqs=1)
    manager.add(req("long-cached", 1000, tenant="batch", cached_len=960, max_tokens=8))
    manager.add(req("short", 300, tenant="batch", max_tokens=8))
    manager.add(req("long", 900, tenant="batch", max_tokens=8))
    order = [ids(manager.next_batch(1000, 16, 0.0))[0] for _ in range(3)]
    expected = ["long-cached", "short", "long"]  # 48, 308, 908 tokens of work
    assert order == (expected if tenant is SJF else expected[::-1])


def test_request_buckets_split_by_effective_length():
    manager = make_manager(max_num_seqs=2)
    for i in range(5):  # long prompts, mostly cached: they compute ~100 tokens
        manager.add(req(f"c{i}", 1000, arrival=float(i), cached_len=896))
    for i in range(4):
        manager.add(req(f"u{i}", 900, arrival=4.0 + i))
    manager.adjust(free_blocks=10_000, block_size=16)
    assert manager.buckets.splits >= 1
    cached = manager.buckets.find(104)
    queued = {r.request_id for q in cached.queues.values() for _, r in q}
    assert queued == {f"c{i}" for i in range(5)}
    assert manager.buckets.find(900) is not cached
    assert manager.snapshot().expected_waste == pytest.approx(
        manager.buckets.expected_waste()  # Eq. 3 over the effective lengths
    )


def test_the_token_budget_counts_computed_tokens_and_kv_the_whole_prompt():
    manager = make_manager(max_batched_tokens=512, max_num_seqs=8, padded=False)
    for i in range(4):
        manager.add(req(i, 1000, arrival=float(i), cached_len=896, max_tokens=24))
    batch = manager.next_batch(free_blocks=10_000, block_size=16, now=9.0)
    assert ids(batch) == [0, 1, 2, 3]  # 4 x 104 computed tokens fit 512
    assert batch.kv_blocks_per_request == (64,) * 4  # (1000 + 24) / 16: the whole prompt
    assert (batch.prompt_tokens, batch.computed_tokens) == (4000, 416)
    assert batch.shape == (4, 104, 7)  # unpadded: its own, the cached prefix as context
    uncached = make_manager(max_batched_tokens=512, max_num_seqs=8, padded=False)
    for i in range(4):
        uncached.add(req(i, 1000, arrival=float(i), max_tokens=24))
    assert ids(uncached.next_batch(10_000, 16, 9.0)) == [0]  # a prompt over the budget alone
    snap = manager.snapshot()
    assert (snap.prompt_tokens, snap.computed_tokens, snap.padded_tokens) == (4000, 416, 416)
    assert snap.tokens_served_by_tenant == {"default": 416.0}  # fair shares count compute


def test_eq_6_memory_still_holds_the_whole_prompt():
    cached, plain = make_manager(), make_manager()
    for manager, cached_len in ((cached, 960), (plain, 0)):
        for i in range(6):
            manager.add(req(i, 1000, arrival=float(i), cached_len=cached_len, max_tokens=24))
    a = cached.next_batch(free_blocks=200, block_size=16, now=9.0)
    b = plain.next_batch(free_blocks=200, block_size=16, now=9.0)
    assert len(a) == len(b) == 2  # 0.9 x 200 = 180 blocks hold two requests of 64
    assert a.kv_blocks == b.kv_blocks == 128


def test_a_padded_batch_runs_its_uncached_tokens_over_a_context_bucket():
    manager = make_manager()  # prompt buckets with every context block count that fits
    manager.add(req("a", 800, cached_len=640))
    manager.add(req("b", 700, cached_len=512))
    batch = manager.next_batch(free_blocks=10_000, block_size=16, now=0.0)
    assert ids(batch) == ["a", "b"]
    assert batch.shape == (2, 256, 5)  # 188 tokens to compute at most, over 5 x 128 cached
    assert not batch.graph_miss
    assert batch.padded_tokens == 512 and batch.waste_ratio == pytest.approx(1 - 174 / 188)


def test_without_a_context_bucket_a_batch_pads_to_its_whole_prompts():
    shapes = ShapeBucketConfig(
        prompt=PromptShapeConfig(bs=BucketRange(1, 2, 4, 3), ctx=BucketRange(0, 1, 0, 1))
    )
    config = BucketManagerConfig(
        request_buckets=RequestBucketConfig(max_len=1024),
        shape_buckets=shapes,
        batching=BatchingConfig(max_batched_tokens=None),
    )
    manager = BucketManager(config)
    manager.add(req("a", 1000, cached_len=896))
    batch = manager.next_batch(free_blocks=10_000, block_size=16, now=0.0)
    assert batch.shape == (1, 1024, 0) and not batch.graph_miss  # no miss: a warmed shape
    assert batch.padded_waste == pytest.approx(1 - 104 / 1024)


def test_a_requeued_batch_returns_to_its_effective_bucket():
    manager = make_manager(max_num_seqs=2)
    for i in range(4):
        manager.add(req(i, 1000, arrival=float(i), cached_len=896))
    batch = manager.next_batch(free_blocks=10_000, block_size=16, now=9.0)
    assert manager.buckets.splits == 1  # [0, 512) holds them all
    manager.requeue(batch)
    assert manager.snapshot().queue_by_bucket[0] == {
        "low": 0,
        "up": 512,
        "queued": 4,
        "by_tenant": {"default": 4},
    }
    assert manager.remove(0).cached_len == 896 and len(manager) == 3


def test_room_for_is_the_fewest_free_blocks_whose_safe_share_holds_a_need():
    controller = BatchingController(BatchingConfig(safety_fraction=0.9))
    for need in range(500):
        room = controller.room_for(need)
        assert controller.safe_blocks(room) >= need
        assert room == 0 or controller.safe_blocks(room - 1) < need
