import dataclasses

from benchmarks.simulator.scale import SCALE_CLUSTER, run_scale, scale_table


def test_a_small_scale_run_accounts_for_every_request_and_its_scheduler_time():
    cluster = dataclasses.replace(SCALE_CLUSTER, num_prefill=3, num_decode=7)
    result = run_scale(cluster, rate=100.0, duration_s=1.0)
    assert result["accelerators"] == 10
    assert result["finished"] == result["requests"] == 100
    per_request = result["bucket_manager_us_per_request"] + result["pd_scheduler_us_per_request"]
    assert result["scheduler_us_per_request"] == per_request
    cpu_s = result["bucket_manager_cpu_s"] + result["pd_scheduler_cpu_s"]
    assert result["scheduler_cpu_per_simulated_s"] == cpu_s / result["arrival_window_s"]
    assert result["keeps_up"] == (result["scheduler_cpu_per_simulated_s"] < 1.0)
    assert result["preemptions"] == 0  # commitments: decode never outgrows its pool
    assert "keeps up" in scale_table(result)
