import itertools
import statistics

import pytest

from benchmarks.simulator.fcfs_disagg import FcfsBatcher
from benchmarks.simulator.workload import WorkloadConfig, make_workload
from bucketserve.bucket_manager import BucketRequest


def test_workloads_are_seeded_and_fit_the_model():
    config = WorkloadConfig(dist="mixed", num_requests=2000, rate=10.0, max_len=4096)
    a, b = make_workload(config), make_workload(config)
    assert a == b
    assert all(1 <= r.prompt_len <= 4096 - 512 for r in a)
    assert all(1 <= r.output_len <= r.max_tokens == 512 for r in a)
    arrivals = [r.arrival for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    gaps = [y - x for x, y in itertools.pairwise(arrivals)]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.1)
    short = make_workload(WorkloadConfig(dist="short", num_requests=2000))
    assert 70 < statistics.fmean(r.prompt_len for r in short) < 100  # Alpaca-like ~83
    assert {r.arrival for r in short} == {0.0}


def test_bad_workload_configs_are_refused():
    with pytest.raises(ValueError, match="dist must be one of"):
        WorkloadConfig(dist="sharegpt")
    with pytest.raises(ValueError, match="rate must be"):
        WorkloadConfig(rate=0.0)
    with pytest.raises(ValueError, match="max_len must be"):
        WorkloadConfig(max_len=100, max_tokens=512)


def test_fcfs_batcher_takes_the_longest_prefix_that_fits():
    batcher = FcfsBatcher(max_num_seqs=3, max_len=4096, max_batched_tokens=900)
    for i, n in enumerate((100, 300, 200, 50, 500)):
        batcher.add(BucketRequest(i, n, 8, arrival_time=float(i)))
    batch = batcher.next_batch(free_blocks=100, block_size=16, now=9.0)
    assert [r.request_id for r in batch.requests] == [0, 1, 2]  # 3 x 300 = 900, max_num_seqs
    assert batch.kv_blocks_per_request == (7, 19, 13)  # ceil((prompt + 1) / 16)
    assert batch.shape == (3, 300, 0)
    assert batcher.next_batch(free_blocks=3, block_size=16, now=9.0) is None  # 50 needs 4
    batch = batcher.next_batch(free_blocks=100, block_size=16, now=9.0)
    assert [r.request_id for r in batch.requests] == [3]  # 2 rows x 500 padded > 900 tokens
    assert len(batcher) == 1
    with pytest.raises(ValueError, match="already queued"):
        batcher.add(BucketRequest(4, 10))
    with pytest.raises(ValueError, match="below max_len"):
        batcher.add(BucketRequest(9, 4096))
    assert len(batcher) == 1


def test_rate_at_80_percent_interpolates_the_first_crossing():
    from benchmarks.simulator.report import rate_at

    assert rate_at([1, 2, 3, 4], [1.0, 0.9, 0.7, 0.5]) == pytest.approx(2.5)
    assert rate_at([1, 2], [0.5, 0.1]) == 0.0  # misses it from the start
    assert rate_at([1, 2], [1.0, 0.9]) == 2  # never falls below: the highest rate tried
    with pytest.raises(ValueError, match="at least one rate"):
        rate_at([], [])


def test_fcfs_batcher_requeues_a_batch_at_the_head_in_order():
    batcher = FcfsBatcher(max_num_seqs=2, max_len=4096)
    for i in range(3):
        batcher.add(BucketRequest(i, 10))
    batch = batcher.next_batch(free_blocks=100, block_size=16, now=0.0)
    batcher.requeue(batch)
    again = batcher.next_batch(free_blocks=100, block_size=16, now=0.0)
    assert [r.request_id for r in again.requests] == [0, 1] and len(batcher) == 1
    batcher.requeue(again)
    with pytest.raises(ValueError, match="already queued"):
        batcher.requeue(again)
    assert len(batcher) == 3
