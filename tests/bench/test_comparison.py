"""The comparison's three systems: their configs, and one real run over the tiny model with
the services started by the harness in child processes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bucketserve.bench.comparison import Comparison, ServiceSpec, system_setup
from bucketserve.bench.config import BenchConfig
from bucketserve.bench.length_distribution import LengthDistribution
from bucketserve.bench.slo import SLO
from bucketserve.bench.workload import WorkloadConfig


def test_the_three_systems_differ_only_in_buckets_policies_and_padding(
    tiny_model_dir: Path,
) -> None:
    spec = ServiceSpec(model=str(tiny_model_dir), max_model_len=256, block_size=4)
    a, a_tenants, a_mix = system_setup("bucketserve", spec)
    b, b_tenants, b_mix = system_setup("fcfs", spec)
    c, c_tenants, _ = system_setup("shape-only", spec)
    assert a.buckets.request_buckets.max_buckets > 1
    assert b.buckets.request_buckets.max_buckets == c.buckets.request_buckets.max_buckets == 1
    assert [t.name for t in a.buckets.tenants] == ["chat", "batch"]
    assert [t.policy for t in a.buckets.tenants] == ["fcfs", "sjf"]
    assert [t.name for t in b.buckets.tenants] == [t.name for t in c.buckets.tenants] == ["default"]
    assert b_tenants is None and c_tenants is None and a_tenants
    assert (a.pad_to_shape_buckets, b.pad_to_shape_buckets, c.pad_to_shape_buckets) == (
        "auto", False, True
    )
    assert a.buckets.shape_buckets == b.buckets.shape_buckets == c.buckets.shape_buckets
    assert a.buckets.batching.fit_batch_buckets
    assert not b.buckets.batching.fit_batch_buckets and not c.buckets.batching.fit_batch_buckets
    assert {t.name for t in a_mix} == {"chat", "batch"} and [t.name for t in b_mix] == ["default"]
    assert [t.max_wait_s for t in a.buckets.tenants] == [30.0, 30.0]  # the tenant default
    # fcfs starts prompts in plain queue order; fcfs-slo adds bucketserve's admission only
    slo, _, _ = system_setup("fcfs-slo", spec)
    assert a.decode.slo_admission and slo.decode.slo_admission
    assert not b.decode.slo_admission and not c.decode.slo_admission
    assert slo == b.model_copy(
        update={"decode": b.decode.model_copy(update={"slo_admission": True})}
    )
    assert (a.decode.scheduling_policy, b.decode.scheduling_policy) == ("priority", "fcfs")
    aged, aged_tenants, _ = system_setup(
        "bucketserve", dataclasses.replace(spec, batch_max_wait_s=2.0)
    )
    assert [t.max_wait_s for t in aged.buckets.tenants] == [30.0, 2.0]
    assert [t.get("max_wait_s") for t in aged_tenants] == [None, 2.0]
    with pytest.raises(ValueError, match="--batch-max-wait must be a number of seconds > 0"):
        dataclasses.replace(spec, batch_max_wait_s=0.0)
    with pytest.raises(ValueError, match="system must be one of"):
        system_setup("vllm", spec)
    with pytest.raises(ValueError, match="unknown systems"):
        Comparison(BenchConfig(), spec, ("bucketserve", "vllm"))


def test_decode_pace_paces_both_systems_to_the_same_tpot_target(tiny_model_dir: Path) -> None:
    spec = ServiceSpec(model=str(tiny_model_dir), max_model_len=256, block_size=4,
                       topology="disaggregated")
    plain, _, _ = system_setup("fcfs", spec)
    assert plain.decode.pace is None and plain.buckets.tenants[0].tpot_slo_s is None
    paced = dataclasses.replace(spec, decode_pace=0.8, tpot_slo_s=0.25)
    for name in ("bucketserve", "fcfs"):
        config, _, _ = system_setup(name, paced)
        assert config.decode.pace == 0.8
        assert {t.tpot_slo_s for t in config.buckets.tenants} == {0.25}
    with pytest.raises(ValueError, match="--decode-pace needs --topology disaggregated"):
        dataclasses.replace(paced, topology="colocated")
    with pytest.raises(ValueError, match=r"--decode-pace must be null .* in \(0, 1\]"):
        dataclasses.replace(paced, decode_pace=2.0)


def test_padded_pads_every_system_and_refuses_shape_only(tiny_model_dir: Path) -> None:
    spec = ServiceSpec(model=str(tiny_model_dir), max_model_len=256, block_size=4, padded=True)
    a, _, _ = system_setup("bucketserve", spec)
    b, _, _ = system_setup("fcfs", spec)
    assert a.pad_to_shape_buckets is True and b.pad_to_shape_buckets is True
    assert a.buckets.request_buckets.max_buckets > 1
    assert b.buckets.request_buckets.max_buckets == 1
    with pytest.raises(ValueError, match="shape-only is fcfs"):
        Comparison(BenchConfig(), spec, ("bucketserve", "shape-only"))
    fit, _, _ = system_setup("fcfs-fit", spec)
    assert fit.buckets.batching.fit_batch_buckets and not b.buckets.batching.fit_batch_buckets
    batching = dataclasses.replace(fit.buckets, batching=b.buckets.batching)
    assert fit.model_copy(update={"buckets": batching}) == b
    with pytest.raises(ValueError, match="fcfs-fit differs from fcfs only in padded batches"):
        Comparison(BenchConfig(), dataclasses.replace(spec, padded=False), ("fcfs-fit",))


def test_graphs_execution_compiles_every_bucket_in_every_system(tiny_model_dir: Path) -> None:
    spec = ServiceSpec(model=str(tiny_model_dir), max_model_len=256, block_size=4,
                       execution="graphs", topology="disaggregated")
    for name in ("bucketserve", "fcfs"):
        config, _, _ = system_setup(name, spec)
        assert config.runner.execution == "graphs" and config.topology == "disaggregated"
        assert config.warmup == "all" and config.pad_to_shape_buckets is True
    assert spec.start_timeout_s > ServiceSpec().start_timeout_s
    eager, _, _ = system_setup("fcfs", ServiceSpec(model=str(tiny_model_dir), max_model_len=256))
    assert (eager.runner.execution, eager.warmup) == ("auto", "smallest")
    assert eager.topology == "colocated"
    with pytest.raises(ValueError, match=r"with --execution graphs .* shape-only is fcfs"):
        Comparison(BenchConfig(), spec, ("bucketserve", "shape-only"))


@pytest.mark.slow
def test_a_comparison_run_over_the_tiny_model(tiny_model_dir: Path) -> None:
    spec = ServiceSpec(model=str(tiny_model_dir), max_model_len=256, block_size=4,
                       num_kv_blocks=512)
    workload = WorkloadConfig(name="mixed", num_requests=8, max_model_len=256, long_fraction=0.3,
                              output=LengthDistribution(8.0, 0.5, 2, 16))
    bench = BenchConfig(model_path=str(tiny_model_dir), workload=workload, rates=[10.0, 40.0],
                        slo=SLO(ttft_s=60.0, tpot_s=10.0), progress=False)
    comparison = Comparison(bench, spec, ("bucketserve", "shape-only"))
    result = comparison.run()
    for name in ("bucketserve", "shape-only"):
        runs = result["systems"][name]["runs"]
        assert [r["rate"] for r in runs] == [10.0, 40.0]
        for run in runs:
            assert run["summary"]["sent"] == run["summary"]["completed"] == 8
            assert run["server"]["generation_tokens"] == sum(
                r.max_tokens for r in comparison.benches[name].make_workload(run["rate"]).requests
            )
        # each rate draws its own prompts (seed + k), the same for every system
        assert [r["seed"] for r in runs] == [0, 1]
        found = result["rate_at_target"]["systems"][name]
        assert found == {"rate": 40.0, "how": "above_sweep"}
    def prompts(name: str, rate: float) -> list[str]:
        return [r.prompt for r in comparison.benches[name].make_workload(rate).requests]

    assert prompts("bucketserve", 10.0) != prompts("bucketserve", 40.0)
    assert prompts("bucketserve", 40.0) == prompts("shape-only", 40.0)
    tenants = {r.tenant for r in comparison.benches["bucketserve"].make_workload(10.0).requests}
    assert tenants == {"chat", "batch"}
    assert result["rate_at_target"]["ratios"] == {"bucketserve/shape-only": 1.0}


def test_the_tenant_pairs_differ_only_in_the_setting_they_compare(tiny_model_dir: Path) -> None:
    spec = ServiceSpec(model=str(tiny_model_dir), max_model_len=256, block_size=4,
                       ttft_slo_s=1.5, tpot_slo_s=0.25)  # fmt: skip
    on, _, mix = system_setup("cache-shares", spec)
    off, _, _ = system_setup("no-cache-shares", spec)
    assert [(t.name, t.cache_share) for t in on.buckets.tenants] == [
        ("chat", None), ("noisy", 0.25)
    ]  # fmt: skip
    assert [(t.name, t.cache_share) for t in off.buckets.tenants] == [
        ("chat", None), ("noisy", None)
    ]  # fmt: skip
    assert [(t.name, t.kind) for t in mix] == [("chat", "chat"), ("noisy", "doc")]
    shed, _, _ = system_setup("shed", spec)
    queue, _, _ = system_setup("queue", spec)
    assert [(t.shed, t.ttft_slo_s, t.tpot_slo_s, t.sheds) for t in shed.buckets.tenants] == [
        ("predicted", 1.5, 0.25, True)
    ]
    assert [(t.shed, t.ttft_slo_s, t.tpot_slo_s) for t in queue.buckets.tenants] == [
        ("never", 1.5, 0.25)
    ]
