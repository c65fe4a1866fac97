"""What users see of prefix caching, mostly on the colocated topology (the default): the
cached prompt tokens in OpenAI usage, the gRPC final message and the SDK, the Prometheus
counters, and `POST /reset_prefix_cache`; then the same count through the P→D handoff."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from bucketserve import Client, SamplingParams
from bucketserve.bucket_manager.config import TenantConfig
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2_grpc as pb_grpc
from bucketserve.runtime.engine.llm import LLM
from tests.gateway.conftest import (
    BLOCK_SIZE,
    fresh_stats,
    local_controller_config,
    start_server,
    wait_until_idle,
)
from tests.gateway.test_metrics import scrape, value

MAX_TOKENS = 4
SHARED = 10 * BLOCK_SIZE  # the prefix two prompts share: 10 full blocks


def prompts(base: int) -> tuple[list[int], list[int]]:
    """Two prompts of the same SHARED-token prefix, then 5 tokens each, unlike from the first."""
    prefix = [base + i for i in range(SHARED)]
    return prefix + [9000 + i for i in range(5)], prefix + [9100 + i for i in range(5)]


@pytest.fixture(scope="module")
def colocated(loop_thread: Any, tiny_model_dir: Path, tenant_registry: Any) -> Iterator[Any]:
    """A Controller of the colocated topology: the decode worker's engine prefills, with its
    prefix cache on (the default)."""
    from bucketserve.controller.controller import Controller

    tenants = [*tenant_registry.bucket_configs(), TenantConfig(name="default")]
    config = local_controller_config(tiny_model_dir, tenants, topology="colocated")
    controller = loop_thread.call(lambda: Controller(config))
    loop_thread.run(controller.start())
    yield controller
    loop_thread.run(controller.shutdown())


@pytest.fixture(scope="module")
def server(loop_thread: Any, colocated: Any) -> Iterator[Any]:
    server = start_server(loop_thread, colocated)
    yield server
    loop_thread.run(server.stop(0))


@pytest.fixture(scope="module")
def keyed_server(loop_thread: Any, colocated: Any, tenant_registry: Any) -> Iterator[Any]:
    server = start_server(loop_thread, colocated, tenant_registry)
    yield server
    loop_thread.run(server.stop(0))


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LLM:
    """The in-process engine without a prefix cache: what every output must equal."""
    return LLM(
        str(tiny_model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64, enable_prefix_caching=False
    )


def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)


def complete(server: Any, prompt: list[int], stream: bool = False) -> tuple[str, Any]:
    """(the choice's text, the usage) of a greedy completion, through the OpenAI client."""
    client = oai(server)
    if not stream:
        out = client.completions.create(
            model=server.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        return out.choices[0].text, out.usage
    chunks = list(
        client.completions.create(
            model=server.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage


def reset(server: Any, headers: dict[str, str] | None = None, method: str = "POST") -> Any:
    request = urllib.request.Request(
        f"{server.http_url}/reset_prefix_cache", method=method, headers=headers or {}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_usage_reports_the_cached_prompt_tokens(
    server: Any, reference: LLM, stream: bool
) -> None:
    first, second = prompts(1000 if stream else 2000)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = reference.generate([first, second], params, use_tqdm=False)
    text, usage = complete(server, first, stream)
    assert text == want[0].text
    assert usage.prompt_tokens == len(first) and usage.completion_tokens == MAX_TOKENS
    assert usage.prompt_tokens_details.cached_tokens == 0
    text, usage = complete(server, second, stream)
    assert text == want[1].text  # the cached prefix changes nothing of the output
    assert usage.prompt_tokens_details.cached_tokens == SHARED


def test_grpc_final_message_and_sdk_carry_the_cached_tokens(server: Any, reference: LLM) -> None:
    first, second = prompts(3000)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = reference.generate([first, second], params, use_tqdm=False)
    with Client(server.grpc_target) as client:
        done = client.generate(first, params)
        assert (done.token_ids, done.cached_tokens) == (want[0].token_ids, 0)
        chunks = list(client.stream(second, params))
    assert [t for c in chunks for t in c.token_ids] == want[1].token_ids
    assert chunks[-1].finished and chunks[-1].cached_tokens == SHARED
    assert all(c.cached_tokens == 0 for c in chunks[:-1])  # a final field
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=second), sampling_params=pb.SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS), stream=False,
    )
    with grpc.insecure_channel(server.grpc_target) as channel:
        (only,) = list(pb_grpc.GenerationStub(channel).Generate(request))
    assert list(only.token_ids) == want[1].token_ids
    usage = only.final.usage
    # the same prompt again: every full block but the one holding its last token is cached
    full = (len(second) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert (usage.prompt_tokens, usage.cached_tokens) == (len(second), full)


def test_prefix_cache_counters_and_hit_rate(loop_thread: Any, colocated: Any, server: Any) -> None:
    first, second = prompts(4000)
    before = fresh_stats(loop_thread, colocated).worker("decode-0")
    complete(server, first)
    complete(server, second)
    stats = wait_until_idle(loop_thread, colocated)
    assert stats.kv_blocks_leaked == 0
    worker = fresh_stats(loop_thread, colocated).worker("decode-0")
    assert worker.prefix_cache_queries - before.prefix_cache_queries == len(first) + len(second)
    assert worker.prefix_cache_hits - before.prefix_cache_hits == SHARED
    families = scrape(server)
    assert families["bucketserve:prefix_cache_queries"].type == "counter"
    queries = value(families, "bucketserve:prefix_cache_queries_total")
    hits = value(families, "bucketserve:prefix_cache_hits_total")
    assert (queries, hits) == (worker.prefix_cache_queries, worker.prefix_cache_hits)
    rate = value(families, "bucketserve:prefix_cache_hit_rate", worker="decode-0", role="decode")
    assert rate == pytest.approx(hits / queries) and 0 < rate < 1


def test_reset_forgets_the_cache(loop_thread: Any, colocated: Any, server: Any) -> None:
    prompt = prompts(5000)[0]
    complete(server, prompt)
    _, usage = complete(server, prompt)
    full = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the block of the last token is computed
    assert usage.prompt_tokens_details.cached_tokens == full
    wait_until_idle(loop_thread, colocated)
    assert len(colocated.dispatcher.pd.decode_cache) > 0  # placement's view of the caches
    status, body = reset(server)
    assert status == 200 and body["forgotten_blocks"] >= full // BLOCK_SIZE
    assert len(colocated.dispatcher.pd.decode_cache) == 0
    assert reset(server) == (200, {"forgotten_blocks": 0})
    _, usage = complete(server, prompt)
    assert usage.prompt_tokens_details.cached_tokens == 0
    _, usage = complete(server, prompt)
    assert usage.prompt_tokens_details.cached_tokens == full


def test_reset_needs_a_tenant_key_where_tenants_are_configured(keyed_server: Any) -> None:
    status, body = reset(keyed_server)
    assert status == 401 and "API key" in body["error"]["message"]
    assert reset(keyed_server, {"Authorization": "Bearer wrong"})[0] == 401
    status, body = reset(keyed_server, {"Authorization": "Bearer alice-key"})
    assert status == 200 and body["forgotten_blocks"] >= 0
    assert reset(keyed_server, method="GET")[0] == 405


def test_the_disaggregated_shape_reports_what_the_prefill_worker_found_cached(
    open_server: Any, reference: LLM
) -> None:
    """The count comes with the prefill worker's first token, through the handoff."""
    first, second = prompts(6000)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = reference.generate([first, second], params, use_tqdm=False)
    with Client(open_server.grpc_target) as client:
        done = [client.generate(p, params) for p in (first, second)]
    assert [d.token_ids for d in done] == [w.token_ids for w in want]
    assert [d.cached_tokens for d in done] == [0, SHARED]
    status, body = reset(open_server)  # the prefill and the decode worker forget theirs
    assert status == 200 and body["forgotten_blocks"] > 0
    with Client(open_server.grpc_target) as client:
        again = client.generate(second, params)
    assert (again.token_ids, again.cached_tokens) == (want[1].token_ids, 0)
