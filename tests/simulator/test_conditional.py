"""The simulator runs the service's own conditional disaggregation: `never` prefills every
request on its decode worker, `always` none, `auto` some (and holds back for a busy prefill
worker what is cheaper there), each losing nothing and giving every block back; a
layer-wise handoff lands K/V when the last layer's chunk does."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.simulator.event_loop import EventLoop
from benchmarks.simulator.hardware import LINKS
from benchmarks.simulator.prefill_worker import PrefillWorker
from benchmarks.simulator.systems import SystemConfig, build
from benchmarks.simulator.workload import make_workload
from tests.simulator.test_simulator import CLUSTER, WORKLOAD, assert_drained


@pytest.mark.parametrize("mode", ["never", "auto", "always"])
def test_each_path_finishes_every_request_once(mode: str) -> None:
    requests = make_workload(dataclasses.replace(WORKLOAD, rate=80.0))
    sim = build("bucketserve", CLUSTER, SystemConfig(remote_prefill=mode))
    result = sim.run(requests)
    assert len(result.finished) == 150
    local = result.stats["local_prefills"]
    assert local == {"never": 150, "always": 0}.get(mode, local)
    if mode == "auto":
        assert 0 < local < 150 and result.stats["held_for_prefill"] > 0
    for request in requests:
        record = sim.records[request.request_id]
        assert request.arrival <= record.prefill_start < record.first_token <= record.finish
    for worker in sim.decode:
        bm = worker.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks and worker.committed == 0
        assert not worker.scheduler.has_unfinished()
    if mode == "always":
        assert_drained(sim)


def test_layer_wise_transfer_lands_with_the_last_layers_chunk() -> None:
    """32 layers computed evenly over a prefill of 0.32 s; the whole transfer takes T: whole,
    the K/V lands T after the prefill; layer by layer, T/32 after it when the link keeps
    up, else when the link has moved all 32 chunks from the first layer on."""
    cost = CLUSTER.cost_model()
    layers = cost.model.num_layers
    link = LINKS["nvlink3"]
    for layerwise in (False, True):
        worker = PrefillWorker(0, EventLoop(), cost, link, layerwise=layerwise)
        worker.loop.now = 10.0  # the prefill ran from 10.0 - latency to now
        tokens = 4096
        whole = cost.transfer_time(tokens, link)
        landed = worker._landing(tokens, latency=0.32)
        if not layerwise:
            assert landed == pytest.approx(10.0 + whole)
        else:
            start, chunk = 10.0 - 0.32, whole / layers
            expected = max(10.0 + chunk, start + 0.32 / layers + layers * chunk)
            assert landed == pytest.approx(expected)
            assert landed < 10.0 + whole
