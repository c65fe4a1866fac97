"""The HTTP API's edge: bad bodies refused with their status and a message naming the
field (and nothing left behind), limits from the gateway config, the request deadline,
continuous usage stats, /tokenize /detokenize /version and /openapi.json."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
import urllib.request
from importlib.metadata import version
from typing import Any

import openai
import pytest

from tests.gateway.abort_checks import slow_decode_steps
from tests.gateway.conftest import http_post, start_server, wait_until_idle

LIMIT_BYTES = 64 * 1024
CHAT = [{"role": "user", "content": "What is a KV cache?"}]


@pytest.fixture(scope="module")
def edge_server(loop_thread: Any, backend: Any) -> Any:
    server = start_server(
        loop_thread, backend, max_message_bytes=LIMIT_BYTES, max_stop_strings=4,
        max_stop_chars=64,
    )
    yield server
    loop_thread.run(server.stop(0))


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hi", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": CHAT, "max_tokens": 2, **fields}


def not_yet(field: str, value: str, neutral: str) -> str:
    return f"{field}={value} is not supported yet by this server; leave it out or send {neutral}"


OVERSIZE = json.dumps(completion(prompt="x" * LIMIT_BYTES)).encode()
BAD_INPUTS = [
    # (path, body, status, the whole message)
    ("/v1/completions", b'{"prompt": "caf\xe9"}', 400,
     "the request body is not valid UTF-8 (byte 15 is 0xe9); send JSON encoded as UTF-8"),
    ("/v1/completions", OVERSIZE, 413,
     f"the request body is {len(OVERSIZE)} bytes, more than this server's limit of "
     f"{LIMIT_BYTES} bytes (gateway.max_message_bytes); send a shorter prompt"),
    ("/v1/completions", completion(stop=["a"] * 10_000), 400,
     "stop has 10000 strings; this server takes at most 4 (gateway.max_stop_strings)"),
    ("/v1/chat/completions", chat(stop=["x" * 40, "y" * 40]), 400,
     "stop strings are 80 characters in all; this server takes at most 64 "
     "(gateway.max_stop_chars)"),
    ("/v1/completions", completion(stop=[1]), 400, "stop must be a string or a list of strings"),
    ("/v1/completions", completion(stop_token_ids=[10**6] * 300), 400,
     "stop_token_ids has 300 ids; this server takes at most 256 (gateway.max_stop_token_ids)"),
    ("/v1/completions", completion(max_tokens="8"), 400, "max_tokens must be an integer, got '8'"),
    ("/v1/completions", completion(temperature=[1]), 400, "temperature must be a number, got [1]"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages must be a list, got 'hi'"),
    ("/v1/completions", completion(ignore_eos="no"), 400,
     "ignore_eos must be true or false, got 'no'"),
    # the new fields: out of range, wrong type, then in range but not implemented yet
    ("/v1/completions", completion(n=0), 400, "n must be >= 1, got 0"),
    ("/v1/completions", completion(presence_penalty=-3), 400,
     "presence_penalty must be >= -2.0, got -3"),
    ("/v1/completions", completion(frequency_penalty=2.5), 400,
     "frequency_penalty must be <= 2.0, got 2.5"),
    ("/v1/completions", completion(repetition_penalty=0), 400,
     "repetition_penalty must be > 0.0, got 0"),
    ("/v1/completions", completion(min_p=1.5), 400, "min_p must be <= 1.0, got 1.5"),
    ("/v1/completions", completion(min_tokens=-1), 400, "min_tokens must be >= 0, got -1"),
    ("/v1/completions", completion(min_tokens=1.5), 400, "min_tokens must be an integer, got 1.5"),
    ("/v1/completions", completion(logprobs=-1), 400, "logprobs must be >= 0, got -1"),
    ("/v1/chat/completions", chat(top_logprobs=21), 400,
     "top_logprobs is 21; this server returns at most 20 top logprobs per token "
     "(gateway.max_logprobs)"),
    ("/v1/chat/completions", chat(logprobs=1), 400, "logprobs must be true or false, got 1"),
    ("/v1/completions", completion(echo="yes"), 400, "echo must be true or false, got 'yes'"),
    ("/v1/completions", completion(n=17), 400,
     "n is 17; this server samples at most 16 choices per request (gateway.max_n)"),
    ("/v1/completions", completion(n=2.0), 400, "n must be an integer, got 2.0"),
    ("/v1/completions", completion(min_p="0.1"), 400, "min_p must be a number, got '0.1'"),
    ("/v1/completions", completion(logprobs=21), 400,
     "logprobs is 21; this server returns at most 20 top logprobs per token "
     "(gateway.max_logprobs)"),
    ("/v1/completions", completion(min_tokens=3), 400,
     "min_tokens must be an integer in [0, max_tokens=2], got 3"),
    ("/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs needs logprobs=true"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=-1), 400,
     "top_logprobs must be >= 0, got -1"),
    ("/v1/completions", completion(echo=True, logprobs=21), 400,
     "logprobs is 21; this server returns at most 20 top logprobs per token "
     "(gateway.max_logprobs)"),
    ("/v1/completions", completion(echo=True, logprobs=-1), 400,
     "logprobs must be >= 0, got -1"),
    ("/v1/completions", completion(echo=True, n=17), 400,
     "n is 17; this server samples at most 16 choices per request (gateway.max_n)"),
    ("/v1/completions", completion(best_of=2), 400, not_yet("best_of", "2", "1")),
    ("/v1/completions", completion(stream=True, stream_options={"continuous_usage_stats": 1}),
     400, "stream_options.continuous_usage_stats must be true or false, got 1"),
    ("/tokenize", {"prompt": 5}, 400, "prompt must be a string, got 5"),
    ("/tokenize", {"prompt": "Hi", "messages": CHAT}, 400,
     "give exactly one of prompt or messages"),
    ("/detokenize", {"tokens": [1, 49152]}, 400,
     "tokens [49152] are not integers in [0, 49152), the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens must be a list, got 'abc'"),
    ("/detokenize", {"tokens": [10**6] * 600}, 400,
     "tokens has 600 ids; this server detokenizes at most 512 (model.max_model_len)"),
    ("/detokenize", {}, 400, "tokens is required"),
]


@pytest.mark.parametrize(("path", "body", "status", "message"), BAD_INPUTS)
def test_bad_input_gets_its_status_and_the_next_request_is_served(
    loop_thread: Any, backend: Any, edge_server: Any, path: str, body: Any, status: int,
    message: str,
) -> None:
    got, answer, _ = http_post(f"{edge_server.http_url}{path}", body)
    assert (got, answer["error"]["message"]) == (status, message)
    assert answer["error"]["code"] == status
    assert answer["error"]["type"] == "invalid_request_error"
    assert edge_server.admission.running == {}
    got, answer, _ = http_post(f"{edge_server.http_url}/v1/completions", completion())
    assert got == 200 and answer["usage"]["completion_tokens"] == 2
    stats = wait_until_idle(loop_thread, backend)
    assert stats.kv_blocks_leaked == 0
    assert all(w.num_free_blocks == w.num_total_blocks for w in stats.workers)


def test_a_chunked_body_over_the_limit_is_413(edge_server: Any) -> None:
    url = urllib.parse.urlsplit(edge_server.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    chunks = iter([b'{"prompt": "', b"x" * LIMIT_BYTES, b'"}'])
    conn.request("POST", "/v1/completions", body=chunks, encode_chunked=True,
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 413
    assert json.loads(response.read())["error"]["message"] == (
        f"the request body is more than this server's limit of {LIMIT_BYTES} bytes "
        "(gateway.max_message_bytes); send a shorter prompt"
    )
    conn.close()


def test_continuous_usage_stats_put_usage_in_every_chunk(edge_server: Any) -> None:
    client = openai.OpenAI(base_url=f"{edge_server.http_url}/v1", api_key="none", max_retries=0)
    chunks = list(client.completions.create(
        model=edge_server.model_name, prompt="Once upon a time", max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    ))
    with_text = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(with_text) >= 2
    assert all(c.usage is not None for c in chunks)
    prompt = {c.usage.prompt_tokens for c in chunks}
    assert len(prompt) == 1 and prompt.pop() > 0
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 6
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)
    assert chunks[-1].choices == []


def test_tokenize_and_detokenize_round_trip(edge_server: Any) -> None:
    tokenizer = edge_server.admission.tokenizer
    url = edge_server.http_url
    text = "Paged attention keeps the KV cache in blocks."
    status, body, _ = http_post(f"{url}/tokenize", {"prompt": text, "return_token_strs": True})
    ids = tokenizer.encode(text)
    assert status == 200
    assert body == {
        "count": len(ids), "max_model_len": edge_server.admission.max_model_len, "tokens": ids,
        "token_strs": [tokenizer.backend.id_to_token(i) for i in ids],
    }
    status, body, _ = http_post(f"{url}/detokenize", {"tokens": ids})
    assert (status, body) == (200, {"prompt": tokenizer.decode(ids, False)})
    status, body, _ = http_post(f"{url}/tokenize", {"messages": CHAT})
    rendered = edge_server.admission.chat_prompt(CHAT)
    assert body["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert body["token_strs"] is None


def test_version_and_openapi(edge_server: Any) -> None:
    with urllib.request.urlopen(f"{edge_server.http_url}/version", timeout=10) as response:
        assert json.loads(response.read()) == {"version": version("bucketserve")}
    with urllib.request.urlopen(f"{edge_server.http_url}/openapi.json", timeout=10) as response:
        schema = json.loads(response.read())
    assert schema["openapi"] == "3.1.0"
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/version",
            "/v1/models"} <= set(schema["paths"])
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/CompletionRequest"
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "repetition_penalty", "min_tokens", "stream_options"} <= set(fields)
    assert "continuous_usage_stats" in schema["components"]["schemas"]["StreamOptions"][
        "properties"]


def test_text_prompts_are_tokenized_off_the_event_loop(
    edge_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = edge_server.admission.tokenizer
    threads: list[str] = []
    encode, template = tokenizer.encode, tokenizer.apply_chat_template

    def spy(fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(tokenizer, "encode", spy(encode))
    monkeypatch.setattr(tokenizer, "apply_chat_template", spy(template))
    for path, body in (("/v1/completions", completion()), ("/v1/chat/completions", chat())):
        status, _, _ = http_post(f"{edge_server.http_url}{path}", body)
        assert status == 200
    assert len(threads) == 3  # encode; template, encode
    assert all(name.startswith("bucketserve-tokenize") for name in threads), threads


@pytest.fixture(scope="module")
def hasty_server(loop_thread: Any, backend: Any) -> Any:
    server = start_server(loop_thread, backend, http_request_timeout_s=HTTP_DEADLINE_S)
    yield server
    loop_thread.run(server.stop(0))


# With every decode step slowed (tests.gateway.abort_checks), LONG takes 20 s: far past the
# deadline, which itself leaves a loaded machine seconds for the first tokens.
HTTP_DEADLINE_S = 3.0
LONG = {"prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True}


def test_a_request_past_the_deadline_is_504_and_aborted(
    loop_thread: Any, backend: Any, hasty_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_decode_steps(backend, monkeypatch)
    status, body, _ = http_post(f"{hasty_server.http_url}/v1/completions", LONG)
    assert status == 504
    assert body["error"]["type"] == "timeout_error"
    message = body["error"]["message"]
    assert message.startswith(
        "the request ran past this server's limit of 3s (gateway.http_request_timeout_s) "
        "and was aborted after "
    )
    assert message.endswith(" tokens; lower max_tokens")
    stats = wait_until_idle(loop_thread, backend)
    assert stats.kv_blocks_leaked == 0 and hasty_server.admission.running == {}


def test_a_stream_past_the_deadline_ends_with_an_error_event(
    loop_thread: Any, backend: Any, hasty_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_decode_steps(backend, monkeypatch)
    request = urllib.request.Request(
        f"{hasty_server.http_url}/v1/completions",
        data=json.dumps({**LONG, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        events = [line[6:] for line in response.read().decode().splitlines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["code"], error["type"]) == (504, "timeout_error")
    assert sum(1 for e in events[:-2] if json.loads(e)["choices"][0]["text"]) >= 1
    stats = wait_until_idle(loop_thread, backend)
    assert stats.kv_blocks_leaked == 0 and hasty_server.admission.running == {}
