"""Pipeline stages in the simulator: the cost of a stage, the hop between stages, and a stage
group that really keeps two microbatches in flight."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.hardware import LINKS
from benchmarks.simulator.systems import build
from benchmarks.simulator.workload import WorkloadConfig, make_workload

GAUDI2 = ClusterConfig(model="llama-2-13b", hardware="gaudi2", link="gaudi2-roce-3x100g",
                       pp_link="gaudi2-roce-3x100g", num_prefill=1, num_decode=1)


def test_a_stage_holds_half_the_layers_and_a_microbatch_crosses_both() -> None:
    one, two = GAUDI2.cost_model(), dataclasses.replace(GAUDI2, pp=2).cost_model()
    model = one.model
    assert two.stage_layers == model.num_layers // 2
    work = one.prefill_work([512, 512])
    head = 2 * model.lm_head_params * work.logits_rows
    dense_one = one.breakdown(work)["dense"]
    dense_two = two.breakdown(work)["dense"]
    layers_one = dense_one * (1 - head / (head + 2 * model.num_layers * model.layer_params * 1024))
    assert dense_two == pytest.approx(dense_one - layers_one / 2, rel=1e-6)
    hop = LINKS["gaudi2-roce-3x100g"].transfer_time(1024 * model.hidden * model.bytes_per_param)
    assert two.hop_time(1024) == pytest.approx(hop)
    assert two.pipeline_latency(work) == pytest.approx(2 * two.time(work) + hop)
    assert one.pipeline_latency(work) == one.time(work) and one.hop_time(1024) == 0
    # each card holds half the weights, so the K/V pool of a 2-stage worker is more than twice
    assert two.kv_capacity_tokens() > 2 * one.kv_capacity_tokens()


def test_a_two_stage_decode_group_keeps_two_microbatches_in_flight() -> None:
    cluster = dataclasses.replace(GAUDI2, pp=2)
    requests = make_workload(WorkloadConfig("mixed", 120, 4.0, cluster.model_spec.max_len))
    sim = build("bucketserve", cluster)
    result = sim.run(requests)
    assert len(result.finished) == len(requests)
    decode = sim.decode[0]
    assert decode.stages.peak_in_flight == 2 and sim.prefill[0].stages.peak_in_flight == 2
    assert 0.0 < decode.stages.bubble_fraction < 1.0
    assert decode.stages.in_flight == 0 and decode.block_manager.num_free_blocks == (
        decode.block_manager.num_total_blocks
    )


def test_pipeline_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="pp must be an integer >= 1"):
        dataclasses.replace(GAUDI2, pp=0).cost_model()
    with pytest.raises(ValueError, match="exceeds llama-2-13b's 40 layers"):
        dataclasses.replace(GAUDI2, pp=41).cost_model()
