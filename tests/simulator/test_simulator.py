"""Conservation and exact timelines of the disaggregated simulator and the static baseline."""

import dataclasses

import pytest

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.decode_worker import DecodeWorker
from benchmarks.simulator.systems import SystemConfig, build
from benchmarks.simulator.workload import SimRequest, WorkloadConfig, make_workload

CLUSTER = ClusterConfig(
    model="llama-2-7b", num_prefill=2, num_decode=2, kv_blocks=160, max_num_seqs=16
)
WORKLOAD = WorkloadConfig(dist="mixed", num_requests=150, rate=40.0, max_len=1024, max_tokens=64)


def run(system: str, requests, cluster=CLUSTER, config=None):
    sim = build(system, cluster, config)
    return sim, sim.run(requests)


def assert_drained(sim) -> None:
    assert len(sim.batcher) == 0
    for worker in sim.decode:
        bm = worker.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks == 160
        assert bm.num_reserved_blocks == 0 and worker.committed == 0
        assert not worker.scheduler.has_unfinished() and not worker.busy
        assert len(worker.leases) == 0 and worker.leases.counts.expired == 0
    assert sum(w.leases.counts.closed for w in sim.decode) == sim.counts["batches"]


@pytest.mark.parametrize("system", ["bucketserve", "fcfs"])
def test_every_request_finishes_once_and_every_block_comes_back(system):
    requests = make_workload(WORKLOAD)
    sim, result = run(system, requests)
    assert len(result.records) == len(result.finished) == 150  # finishing twice raises
    for request in requests:
        record = sim.records[request.request_id]
        assert record.output_len == request.output_len
        assert request.arrival <= record.prefill_start < record.first_token
        assert record.first_token < record.decode_start or request.output_len == 1
        assert record.decode_start <= record.finish
    assert_drained(sim)
    assert result.stats["batched_requests"] == 150
    assert result.stats["real_tokens"] == sum(r.prompt_len for r in requests)


def test_prompt_only_bucketserve_requeues_what_it_cannot_reserve_and_loses_nothing():
    requests = make_workload(dataclasses.replace(WORKLOAD, rate=200.0))
    config = SystemConfig(count_output_tokens=False)
    sim, result = run("bucketserve", requests, config=config)
    assert len(result.finished) == 150
    assert result.stats["batched_requests"] == 150  # counted at launch, after the lease
    assert_drained(sim)


def test_fcfs_preempts_under_memory_pressure_and_bucketserve_never_does():
    requests = make_workload(dataclasses.replace(WORKLOAD, rate=200.0))
    fcfs, fcfs_result = run("fcfs", requests)
    ours, ours_result = run("bucketserve", requests)
    assert fcfs_result.stats["preemptions"] > 0
    assert ours_result.stats["preemptions"] == 0
    assert max(r.preemptions for r in ours_result.records) == 0
    assert len(fcfs_result.finished) == len(ours_result.finished) == 150
    assert_drained(fcfs)
    assert_drained(ours)


def test_requests_that_end_at_their_first_token_never_reach_a_decode_worker():
    """As in the service (PDScheduler.decode_need): max_tokens 1 reserves no decode blocks,
    ships no KV and finishes with its first token; a batch of only such requests takes no
    lease, and the others of a mixed run go on to decode as before."""
    ending = [SimRequest(i, 100 + 10 * i, 1, 1, 0.0) for i in range(4)]
    sim, result = run("bucketserve", ending)
    assert len(result.finished) == 4
    assert all(r.finish == r.first_token and r.decode_start is None for r in sim.records.values())
    assert sim._stats()["leases_closed"] == 0 and sim._stats()["decode_steps"] == 0
    sim, result = run("bucketserve", [*ending, SimRequest(9, 120, 3, 8, 0.0)])
    assert len(result.finished) == 5
    assert all(sim.records[i].decode_start is None for i in range(4))
    going = sim.records[9]
    assert going.first_token < going.decode_start < going.finish
    assert sim._stats()["leases_closed"] == 1


def test_runs_are_deterministic():
    requests = make_workload(WORKLOAD)
    first = [(r.first_token, r.finish) for r in run("bucketserve", requests)[1].records]
    second = [(r.first_token, r.finish) for r in run("bucketserve", requests)[1].records]
    assert first == second


def test_one_request_timeline_is_the_cost_models():
    cluster = dataclasses.replace(CLUSTER, num_prefill=1, num_decode=1)
    sim, result = run("bucketserve", [SimRequest(0, 300, 3, 64, arrival=0.5)], cluster)
    cost = cluster.cost_model()
    record = result.records[0]
    prefill = cost.prefill_time([300], (1, 384))  # the linear shape grid pads to 384
    assert record.first_token == pytest.approx(0.5 + prefill)
    landed = record.first_token + cost.transfer_time(300, cluster.link_spec)
    assert record.decode_start == pytest.approx(landed)
    steps = cost.decode_time(1, 300) + cost.decode_time(1, 301)  # tokens 2 and 3
    assert record.finish == pytest.approx(landed + steps)
    assert result.stats["prefill_padding"] == pytest.approx(1 - 300 / 384)
    assert_drained(sim)


def test_fcfs_pads_to_the_longest_prompt_in_its_batch():
    requests = [SimRequest(i, n, 2, 8, 0.0) for i, n in enumerate((100, 400, 250))]
    sim, result = run("fcfs", requests, dataclasses.replace(CLUSTER, num_prefill=1))
    assert result.stats["batches"] == 2  # the first arrival alone, then the other two
    assert result.stats["padded_tokens"] == 100 + 2 * 400
    assert_drained(sim)


def test_static_batches_wait_for_their_longest_answer():
    cluster = dataclasses.replace(CLUSTER, num_prefill=1, num_decode=0 + 1)
    requests = [SimRequest(0, 100, 2, 8, 0.0), SimRequest(1, 50, 5, 8, 0.0)]
    sim, result = run("static", requests, cluster)
    cost = cluster.cost_model()
    a, b = result.records
    # both replicas are idle at t=0: the first arrival starts alone on one of them
    assert a.first_token == pytest.approx(cost.prefill_time([100], (1, 100)))
    assert a.finish == pytest.approx(a.first_token + cost.decode_time(1, 100))
    assert b.first_token == pytest.approx(cost.prefill_time([50], (1, 50)))
    steps = sum(cost.decode_time(1, 50 + i) for i in range(4))
    assert b.finish == pytest.approx(b.first_token + steps)
    assert sim.queue == type(sim.queue)() and sorted(sim.idle) == [0, 1]


def test_static_conserves_requests_under_load():
    requests = make_workload(WORKLOAD)
    sim, result = run("static", requests)
    assert len(result.finished) == 150
    assert result.stats["batched_requests"] == 150
    assert not sim.queue and sorted(sim.idle) == list(range(CLUSTER.num_workers))
    assert all(r.first_token <= r.finish for r in result.records)


def test_a_request_that_can_never_fit_is_refused_before_anything_runs():
    too_big = SimRequest(7, 2000, 1000, 1000, 0.0)  # 188 blocks > 0.9 x 160
    sim = build("bucketserve", CLUSTER)
    with pytest.raises(ValueError, match="request 7 needs 188 KV blocks"):
        sim.run([too_big])
    assert sim.loop.events_run == 0 and not sim.records
    with pytest.raises(ValueError, match="appears twice"):
        build("fcfs", CLUSTER).run([SimRequest(1, 10, 2, 8, 0.0)] * 2)
    with pytest.raises(ValueError, match="system must be one of"):
        build("vllm", CLUSTER)
    with pytest.raises(ValueError, match="pad must be one of"):
        build("fcfs", CLUSTER, SystemConfig(pad="square"))


def test_decode_worker_room_counts_commitments_or_comebacks():
    sim = build("bucketserve", CLUSTER)
    worker: DecodeWorker = sim.decode[0]
    lease = worker.reserve([5], [31], [10])  # 32 tokens: 2 blocks now, 10 promised
    assert lease.request_ids == ("5",) and lease.num_blocks == 2 and worker.room == 150
    assert worker.land(lease.lease_id) == lease.block_ids and len(worker.leases) == 0
    fcfs = build("fcfs", CLUSTER).decode[0]
    fcfs.reserve([5], [31], [2])
    assert fcfs.room == 158


def test_pd_scheduler_picks_the_most_room_and_follows_every_change():
    sim = build("bucketserve", dataclasses.replace(CLUSTER, num_decode=3))
    pd, (a, b, c) = sim.pd, sim.decode
    assert sim.decode[pd.pick_decode()] is a  # all equal: the lowest index
    a.reserve([1], [15], [50])
    assert sim.decode[pd.pick_decode()] is b
    b.reserve([2], [15], [20])
    c.reserve([3], [15], [30])
    assert sim.decode[pd.pick_decode()] is b  # rooms 110, 140, 130
    lease = b.reserve([4], [15], [40])
    assert sim.decode[pd.pick_decode()] is c and b.room == 100
    b.land(lease.lease_id)
    assert [w.room for w in (a, b, c)] == [110, 100, 130]


def test_varlen_fcfs_computes_only_real_tokens_and_takes_less_prefill_time():
    requests = [SimRequest(i, n, 2, 8, 0.0) for i, n in enumerate((100, 400, 250))]
    cluster = dataclasses.replace(CLUSTER, num_prefill=1)
    padded_sim, _ = run("fcfs", requests, cluster)
    varlen_sim, varlen = run("fcfs", requests, cluster, SystemConfig(pad="none"))
    assert varlen.stats["padded_tokens"] == varlen.stats["real_tokens"] == 750
    assert varlen.stats["prefill_padding"] == 0.0
    cost = cluster.cost_model()
    prefill_s = [w.busy_s for w in varlen_sim.prefill]
    assert prefill_s == [pytest.approx(cost.prefill_time([100]) + cost.prefill_time([400, 250]))]
    assert prefill_s[0] < padded_sim.prefill[0].busy_s
    assert_drained(varlen_sim)


def test_scheduler_cost_is_metered_per_component_in_cpu_and_wall_time():
    _, result = run("bucketserve", make_workload(WORKLOAD))
    stats = result.stats
    for part in ("bucket_manager", "pd_scheduler"):
        assert stats[f"{part}_cpu_s"] > 0 and stats[f"{part}_s"] > 0
    assert stats["max_queued"] >= 1 and stats["bucket_splits"] >= stats["bucket_merges"] >= 0
    fcfs = run("fcfs", make_workload(WORKLOAD))[1].stats
    assert fcfs["bucket_splits"] == fcfs["bucket_merges"] == 0 and fcfs["max_buckets"] == 1
