"""Tenants through the served API (colocated topology, local mode): a prefix cached for one
tenant gives another no `cached_tokens` and the same one all of it; tenants naming one
`cache_domain` share; `cache_salt` (HTTP and gRPC) narrows; per-tenant cache metrics; a
tenant with `shed: predicted` gets a 429 with Retry-After (gRPC RESOURCE_EXHAUSTED with
RetryInfo) once the forecast TTFT misses its target, where one that queues is served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from bucketserve import Client, SamplingParams
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.tenant_registry import TenantRegistry
from tests.gateway.conftest import (
    BLOCK_SIZE,
    fresh_stats,
    http_post,
    local_controller_config,
    start_server,
    wait_until_idle,
)
from tests.gateway.test_grpc_api import raw_generate
from tests.gateway.test_metrics import scrape, value

PROMPT = [7 + i for i in range(15 * BLOCK_SIZE + 3)]  # 15 full blocks and 3 tokens
CACHED = 15 * BLOCK_SIZE
TENANTS = [
    {"name": "a", "api_keys": ["a-key"]},
    {"name": "b", "api_keys": ["b-key"]},
    {"name": "team1", "api_keys": ["team1-key"], "cache_domain": "team"},
    {"name": "team2", "api_keys": ["team2-key"], "cache_domain": "team", "cache_share": 0.5},
    # a 1 ms TTFT target no prompt can meet once the forecast has step costs
    {"name": "shedder", "api_keys": ["shed-key"], "ttft_slo_s": 0.001, "shed": "predicted"},
    {"name": "queuer", "api_keys": ["queue-key"], "ttft_slo_s": 0.001},
    {"name": "patient", "api_keys": ["patient-key"], "ttft_slo_s": 600, "shed": "predicted"},
]


@pytest.fixture(scope="module")
def server(loop_thread: Any, tiny_model_dir: Path) -> Iterator[Any]:
    from bucketserve.controller.controller import Controller

    registry = TenantRegistry.from_dict(TENANTS)
    config = local_controller_config(
        tiny_model_dir, list(registry.bucket_configs()), topology="colocated"
    )
    controller = loop_thread.call(lambda: Controller(config))
    loop_thread.run(controller.start())
    server = start_server(loop_thread, controller, registry)
    yield server
    loop_thread.run(server.stop(0))
    loop_thread.run(controller.shutdown())


def cached_tokens(server: Any, key: str, **extra: Any) -> int:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}
    status, answer, _ = http_post(
        f"{server.http_url}/v1/completions", body, {"Authorization": f"Bearer {key}"}
    )
    assert status == 200, answer
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_shedding_tenant_is_refused_before_any_prompt_was_served(
    server: Any, loop_thread: Any
) -> None:
    # the worker's warm-up probe priced prompts: the forecast needs no served step first
    (worker,) = fresh_stats(loop_thread, server.backend).workers
    assert worker.batches == 0 and worker.prefill_token_s is not None
    status, body, headers = http_post(
        f"{server.http_url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2},
        {"Authorization": "Bearer shed-key"},
    )  # fmt: skip
    assert status == 429, body
    assert int(headers["Retry-After"]) >= 1


def test_a_prefix_cached_for_one_tenant_is_no_hit_for_another(server: Any) -> None:
    assert cached_tokens(server, "a-key") == 0
    assert cached_tokens(server, "b-key") == 0  # a's blocks are not b's to read
    assert cached_tokens(server, "a-key") == CACHED
    assert cached_tokens(server, "b-key") == CACHED  # its own, from its first request


def test_a_shared_domain_shares_and_a_salt_narrows(server: Any) -> None:
    assert cached_tokens(server, "team1-key") == 0
    assert cached_tokens(server, "team2-key") == CACHED
    assert cached_tokens(server, "team2-key", cache_salt="s1") == 0
    assert cached_tokens(server, "team1-key", cache_salt="s1") == CACHED
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT), cache_salt="s2",
        sampling_params=pb.SamplingParams(max_tokens=2, temperature=0),
    )  # fmt: skip
    metadata = (("authorization", "Bearer team1-key"),)
    first, again = (raw_generate(server.grpc_target, request, metadata) for _ in range(2))
    assert first[-1].final.usage.cached_tokens == 0
    assert again[-1].final.usage.cached_tokens == CACHED
    params = SamplingParams(temperature=0, max_tokens=2)
    with Client(server.grpc_target, api_key="team2-key") as sdk:
        salted = [sdk.generate(PROMPT, params, cache_salt="s3") for _ in range(2)]
    assert [c.cached_tokens for c in salted] == [0, CACHED]


def test_a_bad_salt_is_refused_naming_the_field(server: Any) -> None:
    status, body, _ = http_post(
        f"{server.http_url}/v1/completions",
        {"prompt": "x", "max_tokens": 2, "cache_salt": "s" * 300},
        {"Authorization": "Bearer a-key"},
    )
    assert status == 400 and "cache_salt" in body["error"]["message"]


def test_cache_metrics_are_per_tenant(server: Any, loop_thread: Any) -> None:
    for key in ("a-key", "a-key", "b-key"):
        cached_tokens(server, key)
    fresh_stats(loop_thread, server.backend)
    families = scrape(server)
    assert value(families, "bucketserve:prefix_cache_tenant_blocks", tenant="a") >= 15
    queries = value(families, "bucketserve:prefix_cache_tenant_queries_total", tenant="a")
    hits = value(families, "bucketserve:prefix_cache_tenant_hits_total", tenant="a")
    assert queries >= 3 * len(PROMPT) and hits >= 2 * CACHED
    assert value(families, "bucketserve:prefix_cache_tenant_evictions_total", tenant="a") == 0


def test_predicted_misses_are_shed_at_once_with_retry_after(
    server: Any, loop_thread: Any
) -> None:
    # steps run and measured: a prompt of over 32 tokens, then decode steps
    cached_tokens(server, "queue-key")
    stats = fresh_stats(loop_thread, server.backend)
    (worker,) = stats.workers
    assert worker.prefill_token_s is not None and worker.decode_step_s is not None
    url = f"{server.http_url}/v1/completions"
    status, body, headers = http_post(
        url, {"prompt": PROMPT, "max_tokens": 2}, {"Authorization": "Bearer shed-key"}
    )
    assert status == 429, body
    assert int(headers["Retry-After"]) >= 1
    assert "TTFT target of 0.001 s" in body["error"]["message"]
    status, body, _ = http_post(
        url, {"prompt": PROMPT, "max_tokens": 2}, {"Authorization": "Bearer queue-key"}
    )
    assert status == 200  # shed: never queues it, late as it will be
    # one that sheds and is admitted: its first token corrects the next forecasts
    bias = server.backend.dispatcher.ttft_bias
    assert not bias.residuals
    status, body, _ = http_post(
        url, {"prompt": PROMPT, "max_tokens": 2}, {"Authorization": "Bearer patient-key"}
    )
    assert status == 200, body
    assert len(bias.residuals) == 1
    with pytest.raises(grpc.RpcError) as info:
        raw_generate(
            server.grpc_target, pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT)),
            (("authorization", "Bearer shed-key"),),
        )  # fmt: skip
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    (detail,) = rpc_status.from_call(info.value).details
    retry = error_details_pb2.RetryInfo()
    assert detail.Unpack(retry) and retry.retry_delay.ToNanoseconds() >= 1_000_000_000
    assert wait_until_idle(loop_thread, server.backend).kv_blocks_leaked == 0
    shed = scrape(server)["bucketserve:requests_shed"]
    assert [(s.labels["tenant"], s.value) for s in shed.samples] == [("shedder", 3.0)]
