"""The OpenAI-compatible HTTP API, driven by the official `openai` client."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.engine.llm import LLM
from tests.gateway.conftest import BLOCK_SIZE, http_post, wait_for, wait_until_idle

MESSAGES = [{"role": "user", "content": "What is a KV cache?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def engine_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64)


def oai(server: Any, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=api_key, max_retries=0)


def test_openai_client_streams_a_chat_completion_with_usage(
    open_server: Any, engine_llm: LLM
) -> None:
    want = engine_llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0]
    stream = oai(open_server).chat.completions.create(
        model=open_server.model_name,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = [d.content for d in deltas if d.content]
    assert len(content) >= 2
    assert "".join(content) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), 10)
    assert usage.total_tokens == usage.prompt_tokens + 10
    assert all(c.usage is None for c in chunks[:-1])


def test_openai_client_streams_a_completion_with_usage(open_server: Any, engine_llm: LLM) -> None:
    want = engine_llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)[0]
    stream = oai(open_server).completions.create(
        model=open_server.model_name,
        prompt="Once upon a time",
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def test_non_streaming_completions_and_models(open_server: Any, engine_llm: LLM) -> None:
    client = oai(open_server)
    models = client.models.list()
    assert [m.id for m in models.data] == [open_server.model_name]
    chat = client.chat.completions.create(
        model=open_server.model_name, messages=MESSAGES, max_tokens=10, temperature=0
    )
    want = engine_llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0]
    assert chat.choices[0].message.content == want.text
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 10
    completion = client.completions.create(
        model=open_server.model_name, prompt="Once upon a time", max_tokens=3, temperature=0
    )
    assert completion.usage.completion_tokens == 3
    assert completion.id.startswith("cmpl-") and chat.id.startswith("chatcmpl-")


def test_stop_string_ends_with_stop(open_server: Any, engine_llm: LLM) -> None:
    want = engine_llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)[0]
    stop = want.text[len(want.text) // 2 :][:3]
    completion = oai(open_server).completions.create(
        model=open_server.model_name, prompt="Once upon a time", max_tokens=10, temperature=0,
        stop=[stop],
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].text == want.text[: want.text.index(stop)]


def test_openai_errors_have_their_status_and_shape(tenant_server: Any) -> None:
    model = tenant_server.model_name
    with pytest.raises(openai.AuthenticationError) as auth:
        oai(tenant_server).chat.completions.create(model=model, messages=MESSAGES)
    assert auth.value.status_code == 401
    assert auth.value.body["type"] == "authentication_error"
    alice = oai(tenant_server, "alice-key")
    with pytest.raises(openai.BadRequestError, match="temperature must be in"):
        alice.completions.create(model=model, prompt="Hi", temperature=500)
    ignored = alice.completions.create(
        model=model, prompt="Hi", max_tokens=2, extra_body={"bogus": 1}
    )
    assert ignored.usage.completion_tokens == 2  # unknown fields are ignored, as vLLM does
    with pytest.raises(openai.BadRequestError) as n:
        alice.completions.create(model=model, prompt="Hi", n=17)
    assert n.value.body["message"] == (
        "n is 17; this server samples at most 16 choices per request (gateway.max_n)"
    )
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        alice.completions.create(model="gpt-9", prompt="Hi")
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        alice.completions.create(model=model, prompt=[5] * 600)


def test_rate_limit_is_429_with_retry_after(tenant_server: Any) -> None:
    url = f"{tenant_server.http_url}/v1/completions"
    solo = {"Authorization": "Bearer solo-key"}
    client = oai(tenant_server, "solo-key")
    with client.completions.create(
        model=tenant_server.model_name, prompt="Tell me a story", max_tokens=400, stream=True,
        extra_body={"ignore_eos": True},
    ) as stream:
        next(iter(stream))
        status, body, headers = http_post(url, {"prompt": "Hi", "max_tokens": 2}, solo)
        assert status == 429
        assert headers["Retry-After"] == "1"
        assert body["error"]["type"] == "rate_limit_error"
        assert "max_concurrent_requests" in body["error"]["message"]
    wait_for(lambda: not tenant_server.admission.running)  # the server saw the client go
    status, body, _ = http_post(url, {"prompt": "Hi", "max_tokens": 2}, solo)
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_malformed_json_and_unknown_route(open_server: Any) -> None:
    status, body, _ = http_post(f"{open_server.http_url}/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body, _ = http_post(f"{open_server.http_url}/v1/embeddings", {"input": "x"})
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_client_closing_an_sse_stream_frees_blocks(
    loop_thread: Any, backend: Any, open_server: Any
) -> None:
    client = oai(open_server)
    cancelled = loop_thread.call(backend.stats).finish_reasons.get("cancelled", 0)
    stream = client.chat.completions.create(
        model=open_server.model_name, messages=MESSAGES, max_tokens=400, stream=True,
        extra_body={"ignore_eos": True},
    )
    iterator = iter(stream)
    next(iterator)
    next(iterator)
    assert open_server.admission.running
    stream.close()
    wait_for(lambda: not open_server.admission.running)
    stats = wait_until_idle(loop_thread, backend, timeout=10)
    assert stats.finish_reasons["cancelled"] == cancelled + 1
    assert all(w.num_free_blocks == w.num_total_blocks for w in stats.workers)
    assert open_server.admission.running == {}


def test_health_endpoint(open_server: Any) -> None:
    with urllib.request.urlopen(f"{open_server.http_url}/health", timeout=10) as response:
        assert response.status == 200
