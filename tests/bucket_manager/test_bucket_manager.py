import random

import pytest

from bucketserve.bucket_manager import (
    BatchingConfig,
    BucketManager,
    BucketManagerConfig,
    BucketRange,
    BucketRequest,
    PromptShapeConfig,
    RequestBucketConfig,
    ShapeBucketConfig,
    TenantConfig,
)
from bucketserve.bucket_manager.waste import expected_waste
from tests.bucket_manager.helpers import ids, make_manager, req


def state(manager: BucketManager):
    snap = manager.snapshot()
    return len(manager), snap.queue_by_bucket, snap.tokens_served_by_tenant, snap.batches


def test_batch_fits_the_safe_share_of_free_blocks():
    manager = make_manager()
    for i in range(6):
        manager.add(req(i, 20, arrival=float(i), max_tokens=12))  # 32 tokens: 2 blocks of 16
    batch = manager.next_batch(free_blocks=10, block_size=16, now=9.0)  # 0.9 x 10 = 9 blocks
    assert ids(batch) == [0, 1, 2, 3]
    assert batch.kv_blocks_per_request == (2, 2, 2, 2)
    assert batch.kv_blocks == 8 and batch.block_size == 16
    assert len(manager) == 2
    assert manager.next_batch(free_blocks=2, block_size=16, now=9.0) is None  # 1 safe block
    assert len(manager) == 2


def test_prompt_only_accounting_admits_more():
    manager = make_manager(count_output_tokens=False)
    for i in range(6):
        manager.add(req(i, 20, max_tokens=200))
    assert len(manager.next_batch(free_blocks=10, block_size=16, now=0.0)) == 4  # 2 blocks each
    manager = make_manager()
    for i in range(6):
        manager.add(req(i, 20, max_tokens=200))
    assert manager.next_batch(free_blocks=10, block_size=16, now=0.0) is None  # 14 blocks each


def test_the_head_that_does_not_fit_is_not_overtaken():
    manager = make_manager()
    manager.add(req("big", 500, arrival=0.0, max_tokens=100))  # 38 blocks
    manager.add(req("small", 10, arrival=1.0))
    assert manager.next_batch(free_blocks=20, block_size=16, now=5.0) is None
    assert len(manager) == 2 and manager.snapshot().tokens_served_by_tenant == {"default": 0}
    assert ids(manager.next_batch(free_blocks=100, block_size=16, now=5.0)) == ["big", "small"]


def test_batches_are_padded_to_the_smallest_warmed_shape():
    manager = make_manager(fit_batch_buckets=False)  # the bucketing doc's example, as it pads
    for i, length in enumerate((300, 412, 50)):
        manager.add(req(i, length))
    batch = manager.next_batch(free_blocks=10_000, block_size=16, now=0.0)
    assert batch.shape == (4, 512, 0) and not batch.graph_miss
    assert batch.waste_ratio == pytest.approx((412 - 254) / 412)  # Eq. 2
    assert batch.padded_waste == pytest.approx(1 - 762 / (3 * 512))
    assert batch.shape_waste == pytest.approx(1 - 762 / (4 * 512))
    assert batch.padded_tokens == 4 * 512 and batch.prompt_tokens == 762
    assert batch.bucket == (0, 1024)


def test_a_padded_batch_keeps_the_requests_that_fill_a_warmed_batch_size():
    manager = make_manager()  # prompt batch sizes 1, 2, 4
    for i, length in enumerate((300, 412, 50)):
        manager.add(req(i, length))
    first = manager.next_batch(free_blocks=10_000, block_size=16, now=0.0)
    assert ids(first) == [0, 1] and first.shape == (2, 512, 0) and first.shape_waste > 0
    second = manager.next_batch(free_blocks=10_000, block_size=16, now=0.0)
    assert ids(second) == [2] and second.shape == (1, 128, 0)
    assert first.padded_tokens + second.padded_tokens == 2 * 512 + 128  # not 4 x 512
    assert manager.snapshot().padded_tokens == 1152 and len(manager) == 0
    for i in range(4):
        manager.add(req(10 + i, 100))
    assert ids(manager.next_batch(free_blocks=10_000, block_size=16, now=0.0)) == [10, 11, 12, 13]


def test_unpadded_batches_and_batches_beyond_the_buckets_are_not_trimmed():
    unpadded = make_manager(padded=False)
    big = make_manager(max_len=2048)
    for i in range(3):
        unpadded.add(req(i, 300))
        big.add(req(i, 1500))  # longer than every warmed query length: a graph miss
    assert len(unpadded.next_batch(free_blocks=10_000, block_size=16, now=0.0)) == 3
    batch = big.next_batch(free_blocks=10_000, block_size=16, now=0.0)
    assert len(batch) == 3 and batch.graph_miss


def test_a_batch_beyond_every_shape_is_a_counted_graph_miss():
    manager = make_manager(max_len=2048)
    for i in range(5):
        manager.add(req(i, 1500))
    batch = manager.next_batch(free_blocks=10_000, block_size=16, now=0.0)
    assert batch.shape == (4, 1500, 0) and batch.graph_miss  # 4: the largest warmed bs
    assert batch.padded_tokens == 6000  # a miss runs at its own rectangle
    assert batch.padded_waste == batch.shape_waste == 0.0
    assert manager.snapshot().graph_misses == 1


def test_the_token_budget_ends_a_batch_but_a_longer_prompt_goes_alone():
    manager = make_manager(max_batched_tokens=100)
    for i, length in enumerate((40, 40, 40, 150, 10)):
        manager.add(req(i, length, arrival=float(i)))
    take = [ids(manager.next_batch(free_blocks=10_000, block_size=16, now=9.0)) for _ in range(3)]
    assert take == [[0, 1], [2], [3]]  # 40 + 40 + 40 > 100; 150 alone, not starved
    assert ids(manager.next_batch(free_blocks=10_000, block_size=16, now=9.0)) == [4]


def test_unpadded_batches_outgrow_the_warmed_batch_sizes_at_their_own_shape():
    manager = make_manager(max_len=2048, padded=False)
    for i in range(6):
        manager.add(req(i, 1000 + i))
    batch = manager.next_batch(free_blocks=10_000, block_size=16, now=0.0)
    assert len(batch) == 6 and batch.shape == (6, 1005, 0)  # 4 is the largest warmed bs
    assert not batch.graph_miss and manager.snapshot().graph_misses == 0
    assert manager.snapshot().padded_tokens == batch.padded_tokens == sum(range(1000, 1006))
    assert manager.controller.config.max_num_seqs == 256  # not capped at the warmed 4


def test_requeue_restores_the_exact_order_and_accounting():
    manager = make_manager(max_num_seqs=3)
    for i in range(6):
        manager.add(req(i, 100 + i, arrival=float(i)))
    while manager.adjust(free_blocks=10_000, block_size=16):
        pass  # let Algorithm 1 settle: [0, 128) ends up holding all six
    empty = manager.snapshot()
    assert empty.boundaries == [0, 128, 256, 512, 1024]
    batch = manager.next_batch(free_blocks=10_000, block_size=16, now=9.0)
    assert ids(batch) == [0, 1] and len(manager) == 4  # 3 fit; 2 fill a warmed batch size
    assert manager.snapshot().prompt_tokens == 201
    manager.requeue(batch)
    after = manager.snapshot()
    assert (after.prompt_tokens, after.padded_tokens) == (0, 0)
    assert after.tokens_served_by_tenant == empty.tokens_served_by_tenant == {"default": 0}
    assert (after.batches, after.requeued_batches) == (0, 1)
    assert after.queue_by_bucket == empty.queue_by_bucket
    again = manager.next_batch(free_blocks=10_000, block_size=16, now=9.0)
    assert ids(again) == [0, 1]
    assert again.batch_id != batch.batch_id


def test_requeue_into_split_buckets_and_twice_is_rejected():
    manager = make_manager(max_num_seqs=2)
    for i, length in enumerate((100, 700, 150, 800, 120)):
        manager.add(req(i, length, arrival=float(i)))
    batch = manager.next_batch(free_blocks=10_000, block_size=16, now=9.0)
    assert ids(batch) == [0, 2] and batch.bucket == (0, 512)
    manager.requeue(batch)
    before = state(manager)
    with pytest.raises(ValueError, match="request 0 is already queued"):
        manager.requeue(batch)
    assert state(manager) == before
    assert ids(manager.next_batch(free_blocks=10_000, block_size=16, now=9.0)) == [0, 2]


def test_remove_takes_a_queued_request_out():
    manager = make_manager()
    manager.add(req("a", 10))
    manager.add(req("b", 20))
    assert manager.remove("a").prompt_len == 10
    assert manager.remove("a") is None
    assert "a" not in manager and "b" in manager
    assert ids(manager.next_batch(10_000, 16, 0.0)) == ["b"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: req("x", 10, tenant="nobody"), r"unknown tenant 'nobody'; configured tenants"),
        (lambda: req("dup", 10), "request 'dup' is already queued"),
        (lambda: req("x", 1024), r"prompt length 1024 is outside the request buckets \[0, 1024\)"),
        (lambda: "not a request", "add\\(\\) takes a BucketRequest, got str"),
    ],
)
def test_bad_requests_are_rejected_without_changing_state(make, message):
    manager = make_manager()
    manager.add(req("dup", 10))
    before = state(manager)
    with pytest.raises(ValueError, match=message):
        manager.add(make())
    assert state(manager) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1, 16, 0.0), "free_blocks must be an integer >= 0"),
        ((10, 0, 0.0), "block_size must be an integer >= 1"),
        ((10, 16, float("nan")), "now must be a finite number"),
        ((10.5, 16, 0.0), "free_blocks must be an integer"),
    ],
)
def test_bad_next_batch_arguments_change_no_state(args, message):
    manager = make_manager()
    manager.add(req("a", 10))
    before = state(manager)
    with pytest.raises(ValueError, match=message):
        manager.next_batch(*args)
    assert state(manager) == before


def test_request_fields_are_validated():
    with pytest.raises(ValueError, match="request 'r': prompt_len must be an integer >= 1"):
        BucketRequest("r", 0)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        BucketRequest("r", 5, max_tokens=0)
    with pytest.raises(ValueError, match="arrival_time must be finite"):
        BucketRequest("r", 5, arrival_time=float("inf"))


def test_snapshot_reports_buckets_queues_and_expected_waste():
    manager = make_manager(TenantConfig(name="a"), TenantConfig(name="b"), max_num_seqs=2)
    lengths = {"a": (100, 700, 150), "b": (800, 120, 60)}
    for tenant, lens in lengths.items():
        for i, length in enumerate(lens):
            manager.add(req(f"{tenant}{i}", length, arrival=float(i), tenant=tenant))
    assert manager.snapshot().expected_waste == pytest.approx(
        expected_waste([100, 700, 150, 800, 120, 60], [1024])
    )
    batch = manager.next_batch(free_blocks=10_000, block_size=16, now=5.0)
    snap = manager.snapshot()
    assert ids(batch) == ["a0", "a2"]
    assert (snap.num_buckets, snap.splits, snap.merges) == (2, 1, 0)
    assert snap.boundaries == [0, 512, 1024]
    assert snap.n_max == 2 and snap.queued == 4 and snap.batches == 1
    assert snap.queue_by_bucket == [
        {"low": 0, "up": 512, "queued": 2, "by_tenant": {"b": 2}},
        {"low": 512, "up": 1024, "queued": 2, "by_tenant": {"a": 1, "b": 1}},
    ]
    assert snap.queue_by_tenant == {"a": 1, "b": 3}
    assert snap.tokens_served_by_tenant == {"a": 250, "b": 0}
    assert snap.expected_waste == pytest.approx(expected_waste([120, 60, 700, 800], [512, 1024]))
    assert snap.last_waste_ratio == pytest.approx(batch.waste_ratio)
    assert snap.as_dict()["boundaries"] == [0, 512, 1024]


def run_mixed_workload(snap: float, seed: int, fit: bool = False, waves: int = 80):
    """70 % short (lognormal, median ~74) and 30 % long (median ~1480) prompts, model length 6000.

    6000 is not a power of two, so most midpoints miss the warmed edges
    (128 ... 1024, 1408, 1792, 2432, 3328, 4480, 6000). Returns the manager's
    snapshot.
    """
    config = BucketManagerConfig(
        request_buckets=RequestBucketConfig(max_len=6000, shape_edge_snap=snap),
        shape_buckets=ShapeBucketConfig(
            max_model_len=6000,
            prompt=PromptShapeConfig(
                bs=BucketRange(1, 2, 8, 4), query=BucketRange(128, 128, 6000, 14)
            ),
        ),
        # the paper's: memory bounds batches
        batching=BatchingConfig(max_batched_tokens=None, fit_batch_buckets=fit),
    )
    manager = BucketManager(config)
    rng = random.Random(seed)
    for wave in range(waves):
        for i in range(16):
            mu = 4.3 if rng.random() < 0.7 else 7.3
            length = min(5999, max(1, int(rng.lognormvariate(mu, 0.8))))
            manager.add(req(f"{wave}.{i}", length, arrival=float(wave)))
        while len(manager) > 32:
            manager.next_batch(free_blocks=100_000, block_size=128, now=wave)
    return manager.snapshot()


@pytest.mark.parametrize("seed", [0, 1])
def test_splitting_on_shape_edges_lowers_padding_on_a_mixed_workload(seed):
    snapped, plain = run_mixed_workload(0.125, seed), run_mixed_workload(0.0, seed)
    assert snapped.graph_misses == plain.graph_misses == 0
    assert snapped.mean_padded_waste < plain.mean_padded_waste - 0.01


@pytest.mark.parametrize("seed", [0, 1])
def test_filling_batch_sizes_cuts_the_padded_compute_of_a_mixed_workload(seed):
    def padding_share(snapshot) -> float:
        return 1 - snapshot.prompt_tokens / snapshot.padded_tokens

    fit, rows = run_mixed_workload(0.125, seed, fit=True), run_mixed_workload(0.125, seed)
    assert fit.graph_misses == rows.graph_misses == 0
    assert padding_share(fit) < padding_share(rows) - 0.05  # measured 0.23 against 0.32-0.38


def test_n_max_comes_from_free_blocks_and_drives_algorithm_1():
    manager = make_manager()
    for i, length in enumerate((100, 100, 100, 900)):
        manager.add(req(i, length, max_tokens=28))  # 128, 128, 128, 928 tokens: mean 328
    # mean 328 / 16 = 20.5 blocks; 0.9 x 100 = 90 safe blocks -> 4: 4 queued is not > 4
    assert manager.adjust(free_blocks=100, block_size=16) == 0 and manager.n_max == 4
    # 0.9 x 60 = 54 -> N_max 2: 4 > 2 and 3/4 below 512 -> split
    assert manager.adjust(free_blocks=60, block_size=16) == 1 and manager.n_max == 2
    assert manager.snapshot().boundaries == [0, 512, 1024]
    # plenty of room: capped by the largest warmed prompt batch size (4), not max_num_seqs
    manager.adjust(free_blocks=10**6, block_size=16)
    assert manager.n_max == 4
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        manager.adjust(free_blocks=80, block_size=0)
    assert manager.n_max == 4
