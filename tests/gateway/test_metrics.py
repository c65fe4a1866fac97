"""/metrics parses with prometheus_client's parser and moves with traffic."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bucketserve import Client, InvalidArgumentError, SamplingParams
from tests.gateway.conftest import local_controller_config, start_server, wait_until_idle


def scrape(server: Any) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Any], sample_name: str, **labels: str) -> float:
    """The one sample called `sample_name` whose labels include `labels`."""
    family = families[sample_name.removesuffix("_total").removesuffix("_count")]
    matches = [
        s.value for s in family.samples
        if s.name == sample_name and labels.items() <= s.labels.items()
    ]
    assert len(matches) == 1, (sample_name, labels, family.samples)
    return matches[0]


@pytest.fixture(scope="module")
def own_backend(loop_thread: Any, tiny_model_dir: Path, tenant_registry: Any) -> Any:
    """A controller of its own, so the counters the workers and the bucket manager keep
    start at zero too; its decode pool (12 blocks of 4) holds one 24-token sample of a
    short prompt but not three."""
    from bucketserve.controller.controller import Controller

    config = local_controller_config(tiny_model_dir, tenant_registry.bucket_configs())
    runner = config.runner.model_copy(update={"num_kv_blocks": 12})
    config = config.model_copy(update={"runner": runner})
    controller = loop_thread.call(lambda: Controller(config))
    loop_thread.run(controller.start())
    yield controller
    loop_thread.run(controller.shutdown())


@pytest.fixture
def fresh_server(loop_thread: Any, own_backend: Any, tenant_registry: Any) -> Any:
    """Its own registry: every counter starts at zero."""
    server = start_server(loop_thread, own_backend, tenant_registry)
    yield server
    loop_thread.run(server.stop(0))


def test_metrics_parse_and_move_with_traffic(
    loop_thread: Any, own_backend: Any, fresh_server: Any
) -> None:
    backend = own_backend
    before = scrape(fresh_server)
    for name in (
        "bucketserve:time_to_first_token_seconds",
        "bucketserve:inter_token_latency_seconds",
        "bucketserve:e2e_request_latency_seconds",
        "bucketserve:request_queue_time_seconds",
    ):
        assert before[name].type == "histogram"
    assert value(before, "bucketserve:e2e_request_latency_seconds_count") == 0
    assert value(before, "bucketserve:num_requests_running") == 0
    assert value(before, "bucketserve:request_buckets") >= 1
    assert before["bucketserve:kv_cache_usage_perc"].samples
    prompt_tokens = before.get("bucketserve:prompt_tokens")
    assert prompt_tokens is None or not prompt_tokens.samples

    params = SamplingParams(temperature=0, max_tokens=6)
    with Client(fresh_server.grpc_target, api_key="slo-key") as client:
        done = [client.generate(p, params) for p in ("Hello", "The sky is", "One two three")]
        with pytest.raises(InvalidArgumentError, match="request_id"):
            client.generate("x", SamplingParams(temperature=0), request_id="r" * 300)
    bad = urllib.request.Request(  # refused while its body is read: counted all the same
        f"{fresh_server.http_url}/v1/completions",
        data=b'{"prompt": "x", "max_tokens": ',  # cut short: not JSON
        headers={"Content-Type": "application/json", "Authorization": "Bearer slo-key"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(bad, timeout=30)
    assert refused.value.code == 400
    wait_until_idle(loop_thread, backend)
    after = scrape(fresh_server)
    model, tenant = fresh_server.model_name, "slo"
    assert value(after, "bucketserve:prompt_tokens_total", tenant=tenant) == sum(
        d.prompt_tokens for d in done
    )
    assert value(after, "bucketserve:generation_tokens_total", tenant=tenant) == 18
    # unpadded on the CPU, prefill runs exactly the prompt tokens (the backend is shared with
    # other tests: count this test's batches only)
    names = ("prefill_batch_tokens_total", "prefill_computed_tokens_total",
             "prefill_padded_tokens_total")
    for name in names:
        ran = value(after, f"bucketserve:{name}") - value(before, f"bucketserve:{name}")
        assert ran == sum(d.prompt_tokens for d in done), name
    assert value(after, "bucketserve:request_success_total", finished_reason="length") == 3
    assert value(after, "bucketserve:e2e_request_latency_seconds_count", model_name=model) == 3
    assert value(after, "bucketserve:time_to_first_token_seconds_count") == 3
    assert value(after, "bucketserve:inter_token_latency_seconds_count") == 15
    assert value(after, "bucketserve:request_queue_time_seconds_count") == 3
    assert value(after, "bucketserve:request_rejected_total", code="INVALID_ARGUMENT") == 2
    assert value(after, "bucketserve:slo_attainment", tenant=tenant) == 1.0  # 60 s targets
    with Client(fresh_server.grpc_target, api_key="slo-key") as client:
        client.generate("Hello", params, ttft_slo_s=1e-9)  # the request's own target: missed
    assert value(scrape(fresh_server), "bucketserve:slo_attainment", tenant=tenant) == 0.75
    usage = after["bucketserve:kv_cache_usage_perc"].samples
    assert {s.labels["role"] for s in usage} >= {"decode"}
    assert all(0.0 <= s.value <= 1.0 for s in usage)
    used = after["bucketserve:kv_cache_blocks_used"].samples  # drained: every block free
    assert {s.labels["role"] for s in used} >= {"decode"} and all(s.value == 0 for s in used)
    # one request at a time: no bucket ever holds more than one, so none splits or merges;
    # each batch is one unpadded prompt (no waste); 60 s targets hold nothing back; three
    # short requests fit the pool (no preemption); nothing waits once drained
    for name in (
        "bucketserve:num_preemptions_total",
        "bucketserve:slo_admission_holds_total",
        "bucketserve:bucket_splits_total",
        "bucketserve:bucket_merges_total",
        "bucketserve:padding_waste_ratio",
        "bucketserve:num_requests_waiting",
    ):
        assert value(after, name) == 0, name
    assert value(after, "bucketserve:request_buckets") == 1
    # three 24-token samples of one prompt outgrow the 12-block pool: the engine preempts
    with Client(fresh_server.grpc_target, api_key="slo-key") as client:
        three = client.generate(
            "Hello", SamplingParams(temperature=1.0, seed=3, max_tokens=24, n=3, ignore_eos=True)
        )
    assert [s.finish_reason for s in three.choices] == ["length"] * 3
    wait_until_idle(loop_thread, backend)
    assert value(scrape(fresh_server), "bucketserve:num_preemptions_total") > 0
    assert "bucketserve:graph_misses" in after
    assert value(after, "bucketserve:decode_paced_seconds_total") == 0.0  # pacing is off
    bubbles = after["bucketserve:pipeline_bubble_fraction"].samples  # one stage: no bubble
    assert bubbles and all(s.value == 0.0 for s in bubbles)
    assert "bucketserve:pipeline_microbatches_in_flight" in after


def test_servers_in_one_process_keep_separate_registries(
    open_server: Any, tenant_server: Any
) -> None:
    assert open_server.metrics.registry is not tenant_server.metrics.registry
