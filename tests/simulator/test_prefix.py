"""The shared-prefix workload, prefix caching in the simulated workers, and cache-aware
placement against least-loaded (a small, fast instance of `python -m benchmarks.simulator
prefix`)."""

import dataclasses

import pytest

from benchmarks.simulator.__main__ import main
from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.prefill_worker import PrefillWorker
from benchmarks.simulator.prefix import prefix_table, run_prefix
from benchmarks.simulator.systems import SystemConfig, build
from benchmarks.simulator.workload import (
    PrefixWorkloadConfig,
    SimRequest,
    make_prefix_workload,
    prompt_tokens,
)

CLUSTER = ClusterConfig(
    model="llama-2-7b", num_prefill=2, num_decode=2, kv_blocks=400, max_num_seqs=16
)
# 36 prefixes of 16 blocks: more than a worker's 400 blocks hold, fewer than two workers'
WORKLOAD = PrefixWorkloadConfig(
    num_prefixes=36, prefix_len=256, suffix_len=(16, 64), num_requests=400, rate=20.0,
    max_len=1024, max_tokens=32,
)  # fmt: skip
CACHING = SystemConfig(prefix_caching=True, max_batches_per_prefill=2)
CACHE_AWARE = dataclasses.replace(CACHING, cache_aware=True)


def run(config: SystemConfig, requests: list[SimRequest]):
    sim = build("bucketserve", CLUSTER, config)
    return sim, sim.run(requests)


def test_prefix_workloads_are_seeded_and_share_their_prefixes():
    a, b = make_prefix_workload(WORKLOAD), make_prefix_workload(WORKLOAD)
    assert a == b and len(a) == 400
    assert {r.prefix for r in a} == set(range(36))
    assert all(256 + 16 <= r.prompt_len <= 256 + 64 and r.prefix_len == 256 for r in a)
    x, y = (r for r in a if r.prefix == a[0].prefix and r is not a[0]), a[0]
    x = next(x)
    assert prompt_tokens(x)[:256] == prompt_tokens(y)[:256]
    assert prompt_tokens(x)[256] != prompt_tokens(y)[256]
    assert min(min(prompt_tokens(r)) for r in a) >= 3  # clear of the decode's TOKEN and EOS
    zipf = make_prefix_workload(dataclasses.replace(WORKLOAD, zipf=1.2, num_requests=2000))
    counts = [sum(r.prefix == k for r in zipf) for k in range(36)]
    assert counts[0] > 2 * counts[3] > 0
    with pytest.raises(ValueError, match="max_len must be"):
        PrefixWorkloadConfig(prefix_len=1000, suffix_len=(1, 100), max_len=1024, max_tokens=32)


def test_a_prefill_worker_computes_what_its_cache_lacks_but_not_within_one_batch():
    worker = PrefillWorker(0, None, CLUSTER.cost_model(), CLUSTER.link_spec, 64, 16)
    shared = [7] * 64
    assert worker.lookup([shared + [1] * 10, shared + [2] * 10]) == [0, 0]
    assert worker.lookup([shared + [3] * 10, [9] * 40]) == [64, 0]
    assert worker.lookup([shared]) == [48]  # its last token is always computed
    assert worker.cache.num_free_blocks == 64  # nothing held between batches


@pytest.mark.parametrize("config", [CACHING, CACHE_AWARE], ids=["least-loaded", "cache-aware"])
def test_prefix_caching_computes_each_prompt_once_and_returns_every_block(config):
    requests = make_prefix_workload(WORKLOAD)
    sim, result = run(config, requests)
    assert len(result.finished) == 400
    stats = result.stats
    assert stats["real_tokens"] + stats["cached_tokens"] == sum(r.prompt_len for r in requests)
    assert stats["cached_tokens"] > 0 and stats["unshipped_tokens"] > 0
    for worker in sim.decode:
        bm = worker.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks and bm.num_reserved_blocks == 0
        assert worker.committed == 0 and not worker.cached_blocks
    for worker in sim.prefill:
        assert worker.cache.num_free_blocks == worker.cache.num_total_blocks
        assert worker.assigned == worker.pending_blocks == 0
    assert sim.pd.prefill_queued == {}
    assert not sim._tokens


def test_cache_aware_placement_reuses_more_than_least_loaded():
    requests = make_prefix_workload(WORKLOAD)
    aware = run(CACHE_AWARE, requests)[1].stats
    blind = run(CACHING, requests)[1].stats
    # each prefill worker keeps its share rather than all of them, half of which it evicts
    assert aware["cached_tokens"] > 1.2 * blind["cached_tokens"]
    uncached = run(SystemConfig(max_batches_per_prefill=2), requests)[1].stats
    assert uncached["cached_tokens"] == 0 == uncached["unshipped_tokens"]
    assert uncached["real_tokens"] == sum(r.prompt_len for r in requests)


def test_cache_aware_needs_caching():
    with pytest.raises(ValueError, match="needs prefix caching"):
        build("bucketserve", CLUSTER, SystemConfig(cache_aware=True))


def test_the_prefix_experiment_reports_the_rate_at_80_percent():
    small = PrefixWorkloadConfig(num_prefixes=6, prefix_len=128, max_len=1024, max_tokens=16)
    result = run_prefix(CLUSTER, small, rates=(5.0, 10.0), duration_s=3.0)
    assert set(result["rate_at_80"]) == {"cache-aware", "least-loaded", "no-cache"}
    assert len(result["rows"]) == 6
    assert all(r["finished"] == r["requests"] for r in result["rows"])
    assert "Rate at 80 % SLO" in prefix_table(result)


def test_the_cli_refuses_bad_prefix_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["prefix", "--prefixes", "0", "--out", str(tmp_path)])
    assert "--prefixes must be positive, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["prefix", "--zipf", "-1", "--out", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []
