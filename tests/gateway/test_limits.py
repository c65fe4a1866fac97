"""Every list and text a request can carry is bounded and counted before any of its elements
is looked at: a million stop token ids, a 1.5M-id prompt or a million ids to detokenize get a
400 / INVALID_ARGUMENT naming the field, the limit and its config key, with no id checked,
nothing tokenized and nothing converted per element. Run with -s to see how long each
refusal took (printed, not asserted: the assertions are on what came back)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from bucketserve.gateway import grpc_servicer
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2_grpc as pb_grpc
from tests.gateway.abort_checks import slow_decode_steps
from tests.gateway.conftest import http_post, start_server, wait_for, wait_until_idle

MILLION = 1_000_000
PAST_VOCAB = 10**6  # an id no vocabulary here has: the count is refused before any id is


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hi", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def prompt_message(server: Any, n: int) -> str:
    model = server.admission.model
    return (
        f"the prompt has {n} tokens but this service admits at most {model.max_prompt_len} "
        f"(model.max_model_len is {model.max_model_len}); shorten the prompt"
    )


STOP_IDS = (
    "stop_token_ids has 1000000 ids; this server takes at most 256 (gateway.max_stop_token_ids)"
)
CHARS = (
    "prompt is 2000000 characters; this server takes at most 1000000 before tokenizing "
    "(gateway.max_prompt_chars); shorten it"
)
MESSAGES = (
    "messages has 1000000 entries; this server takes at most 4096 (gateway.max_chat_messages)"
)
# (name, path, body, the whole message: text, or from the server)
HTTP_CASES: list[tuple[str, str, Callable[[], Any], str | Callable[[Any], str]]] = [
    ("1M valid stop_token_ids", "/v1/completions",
     lambda: completion(stop_token_ids=[5] * MILLION), STOP_IDS),
    ("1M out-of-range stop_token_ids", "/v1/chat/completions",
     lambda: chat(stop_token_ids=[PAST_VOCAB] * MILLION), STOP_IDS),
    ("1.5M-id prompt", "/v1/completions",
     lambda: completion(prompt=[PAST_VOCAB] * 1_500_000),
     lambda server: prompt_message(server, 1_500_000)),
    ("1.5M-id prompt in a list", "/v1/completions",
     lambda: completion(prompt=[[5] * 1_500_000]),
     lambda server: prompt_message(server, 1_500_000)),
    ("1M ids to detokenize", "/detokenize", lambda: {"tokens": [PAST_VOCAB] * MILLION},
     lambda server: f"tokens has 1000000 ids; this server detokenizes at most "
                    f"{server.admission.max_model_len} (model.max_model_len)"),
    ("2M characters to tokenize", "/tokenize", lambda: {"prompt": "x" * 2 * MILLION}, CHARS),
    ("2M-character prompt", "/v1/completions", lambda: completion(prompt="x" * 2 * MILLION),
     CHARS),
    ("1M chat messages", "/v1/chat/completions", lambda: {"messages": [{}] * MILLION},
     MESSAGES),
    ("1M messages to tokenize", "/tokenize", lambda: {"messages": [{}] * MILLION}, MESSAGES),
    ("400k content parts", "/v1/chat/completions",
     lambda: {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 400_000}]},
     "a message's content has 400000 parts; this server takes at most 4096 "
     "(gateway.max_chat_messages)"),
    ("1.2M characters of chat", "/v1/chat/completions",
     lambda: {"messages": [{"role": "user", "content": "x" * 1_200_000}]},
     "messages' content is 1200000 characters; this server takes at most 1000000 before "
     "tokenizing (gateway.max_prompt_chars); shorten it"),
    ("1M stop strings", "/v1/completions", lambda: completion(stop=["a"] * MILLION),
     "stop has 1000000 strings; this server takes at most 64 (gateway.max_stop_strings)"),
    ("1M logit_bias entries", "/v1/completions",
     lambda: completion(logit_bias={str(i): 1.0 for i in range(MILLION)}),
     "logit_bias has 1000000 entries; this server takes at most 1024 "
     "(gateway.max_logit_bias)"),
    ("100k tools", "/v1/chat/completions", lambda: chat(tools=[TOOL] * 100_000),
     "tools has 100000 entries; this server takes at most 128 (gateway.max_tools)"),
    ("1M allowed_token_ids", "/v1/completions",
     lambda: completion(allowed_token_ids=[5] * MILLION),
     "allowed_token_ids=<1000000 items> is not supported yet by this server; leave it out "
     "or send None"),
    ("priority past int32", "/v1/completions", lambda: completion(priority=2**31),
     "priority must be an integer in [-2147483648, 2147483647] (lower is served first "
     "among your tenant's requests), got 2147483648"),
]


@pytest.fixture(scope="module")
def roomy_server(loop_thread: Any, backend: Any) -> Iterator[Any]:
    """Bodies past the default gateway.max_message_bytes, so each field's own limit speaks."""
    server = start_server(loop_thread, backend, max_message_bytes=64 * MILLION)
    yield server
    loop_thread.run(server.stop(0))


def test_a_body_past_max_message_bytes_is_refused_unread(open_server: Any) -> None:
    limit = open_server.config.max_message_bytes
    data = json.dumps(completion(stop_token_ids=[5] * (limit // 3))).encode()
    assert len(data) > limit
    status, answer, _ = http_post(f"{open_server.http_url}/v1/completions", data)
    assert status == 413 and "gateway.max_message_bytes" in answer["error"]["message"]
    with grpc.insecure_channel(open_server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[PAST_VOCAB] * (limit // 3)))
        assert request.ByteSize() > limit
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert open_server.admission.running == {}


@pytest.fixture
def per_element(roomy_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the per-element steps that ran: id checks, tokenizing, detokenizing,
    chat templates, the gRPC message's conversion."""
    calls: list[str] = []
    admission = roomy_server.admission

    def spy(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    spy(admission, "token_ids")
    for name in ("encode", "decode", "apply_chat_template"):
        spy(admission.tokenizer, name)
    spy(grpc_servicer, "request_to_input")
    yield calls


@pytest.mark.parametrize(("path", "body", "message"), [c[1:] for c in HTTP_CASES],
                         ids=[c[0] for c in HTTP_CASES])
def test_an_oversized_http_input_is_refused_before_any_work_per_element(
    roomy_server: Any, per_element: list[str], path: str, body: Callable[[], Any],
    message: str | Callable[[Any], str], capsys: pytest.CaptureFixture[str],
) -> None:
    data = json.dumps(body()).encode()
    started = time.perf_counter()
    status, answer, _ = http_post(f"{roomy_server.http_url}{path}", data)
    took = time.perf_counter() - started
    want = message if isinstance(message, str) else message(roomy_server)
    assert (status, answer["error"]["message"]) == (400, want)
    assert answer["error"]["type"] == "invalid_request_error"
    assert per_element == []
    assert roomy_server.admission.running == {}
    with capsys.disabled():
        print(f"\n  HTTP {path} {len(data) / 1e6:.1f} MB: 400 after {took * 1000:.0f} ms")


GRPC_CASES: list[tuple[str, Callable[[], pb.GenerateRequest], str | Callable[[Any], str]]] = [
    ("1.5M-id prompt", lambda: pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[PAST_VOCAB] * 1_500_000)),
     lambda server: prompt_message(server, 1_500_000)),
    ("1M stop_token_ids", lambda: pb.GenerateRequest(
        text="Hi", sampling_params=pb.SamplingParams(stop_token_ids=[PAST_VOCAB] * MILLION)),
     STOP_IDS),
    ("2M-character prompt", lambda: pb.GenerateRequest(text="x" * 2 * MILLION), CHARS),
    ("1M chat messages", lambda: pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage()] * MILLION)), MESSAGES),
    ("1M stop strings", lambda: pb.GenerateRequest(
        text="Hi", sampling_params=pb.SamplingParams(stop=["a"] * MILLION)),
     "stop has 1000000 strings; this server takes at most 64 (gateway.max_stop_strings)"),
]


@pytest.mark.parametrize(("request_", "message"), [c[1:] for c in GRPC_CASES],
                         ids=[c[0] for c in GRPC_CASES])
def test_an_oversized_grpc_request_is_refused_before_any_work_per_element(
    roomy_server: Any, per_element: list[str], request_: Callable[[], pb.GenerateRequest],
    message: str | Callable[[Any], str], capsys: pytest.CaptureFixture[str],
) -> None:
    request = request_()
    with grpc.insecure_channel(roomy_server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)  # connected before timing
        started = time.perf_counter()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=60))
        took = time.perf_counter() - started
    want = message if isinstance(message, str) else message(roomy_server)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, want)
    assert per_element == []
    assert roomy_server.admission.running == {}
    with capsys.disabled():
        size = request.ByteSize() / 1e6
        print(f"\n  gRPC {size:.1f} MB: INVALID_ARGUMENT after {took * 1000:.0f} ms")


@pytest.fixture(scope="module")
def tight_server(loop_thread: Any, backend: Any) -> Any:
    server = start_server(
        loop_thread, backend, max_n=2, max_logprobs=3, max_chat_messages=2,
        max_prompt_chars=40, max_stop_token_ids=4, max_logit_bias=2, max_tools=1,
    )
    yield server
    loop_thread.run(server.stop(0))


TIGHT = [
    # (OpenAI path, body, gRPC request or None, the message both give)
    ("/v1/completions", completion(n=3), pb.GenerateRequest(
        text="Hi", sampling_params=pb.SamplingParams(max_tokens=2, n=3)),
     "n is 3; this server samples at most 2 choices per request (gateway.max_n)"),
    ("/v1/completions", completion(logprobs=4), pb.GenerateRequest(
        text="Hi", sampling_params=pb.SamplingParams(max_tokens=2, logprobs=4)),
     "logprobs is 4; this server returns at most 3 top logprobs per token "
     "(gateway.max_logprobs)"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=4), None,
     "top_logprobs is 4; this server returns at most 3 top logprobs per token "
     "(gateway.max_logprobs)"),
    ("/v1/completions", completion(echo=True, logprobs=4), pb.GenerateRequest(
        text="Hi", sampling_params=pb.SamplingParams(max_tokens=2, prompt_logprobs=4)),
     None),  # gRPC names prompt_logprobs: below
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 3},
     pb.GenerateRequest(chat=pb.ChatMessages(
         messages=[pb.ChatMessage(role="user", content="a")] * 3)),
     "messages has 3 entries; this server takes at most 2 (gateway.max_chat_messages)"),
    ("/v1/completions", completion(prompt="x" * 41), pb.GenerateRequest(text="x" * 41),
     "prompt is 41 characters; this server takes at most 40 before tokenizing "
     "(gateway.max_prompt_chars); shorten it"),
    ("/v1/completions", completion(stop_token_ids=[1] * 5), pb.GenerateRequest(
        text="Hi", sampling_params=pb.SamplingParams(max_tokens=2, stop_token_ids=[1] * 5)),
     "stop_token_ids has 5 ids; this server takes at most 4 (gateway.max_stop_token_ids)"),
    ("/v1/completions", completion(logit_bias={"1": 1.0, "2": 1.0, "3": 1.0}), None,
     "logit_bias has 3 entries; this server takes at most 2 (gateway.max_logit_bias)"),
    ("/v1/chat/completions", chat(tools=[TOOL, TOOL]), None,
     "tools has 2 entries; this server takes at most 1 (gateway.max_tools)"),
]


@pytest.mark.parametrize(("path", "body", "request_", "message"), TIGHT)
def test_each_limit_is_the_config_key_it_names(
    tight_server: Any, path: str, body: Any, request_: pb.GenerateRequest | None,
    message: str | None,
) -> None:
    status, answer, _ = http_post(f"{tight_server.http_url}{path}", body)
    http_message = message or (
        "logprobs is 4; this server returns at most 3 top logprobs per token "
        "(gateway.max_logprobs)"
    )
    assert (status, answer["error"]["message"]) == (400, http_message)
    if request_ is None:
        return
    with grpc.insecure_channel(tight_server.grpc_target) as channel, \
            pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.GenerationStub(channel).Generate(request_, timeout=60))
    grpc_message = message or (
        "prompt_logprobs is 4; this server returns at most 3 top logprobs per token "
        "(gateway.max_logprobs)"
    )
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, grpc_message
    )
    assert tight_server.admission.running == {}


def test_within_the_limits_the_request_is_served(loop_thread: Any, backend: Any,
                                                 tight_server: Any) -> None:
    body = completion(prompt="x" * 40, n=2, logprobs=3, stop_token_ids=[1] * 4)
    status, answer, _ = http_post(f"{tight_server.http_url}/v1/completions", body)
    assert status == 200 and len(answer["choices"]) == 2
    assert all(len(c["logprobs"]["tokens"]) >= 1 for c in answer["choices"])
    stats = wait_until_idle(loop_thread, backend)
    assert all(w.num_free_blocks == w.num_total_blocks for w in stats.workers)


IDLE_S = 1.0  # the test's gateway.grpc_stream_idle_timeout_s (the default is 60 s)
# The client takes at most ~1 KiB it does not read: HTTP/2 flow control then holds the
# server's writes back after a few dozen responses (no window growth from BDP probes).
STALLED_CLIENT = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def idle_server(loop_thread: Any, backend: Any, tenant_registry: Any) -> Any:
    server = start_server(
        loop_thread, backend, tenant_registry, grpc_stream_idle_timeout_s=IDLE_S
    )
    yield server
    loop_thread.run(server.stop(0))


def test_a_grpc_client_that_stops_reading_loses_its_stream_and_frees_its_slot(
    loop_thread: Any, backend: Any, idle_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tenant `solo` may run one request. Its stream, with no deadline, stops being read
    after the first response; slowed decode steps keep it generating for 20 s. The idle
    limit aborts it, so solo's next request is served, and the stalled client reading on
    finds the status naming the key."""
    slow_decode_steps(backend, monkeypatch)
    solo = (("authorization", "Bearer solo-key"),)
    long = pb.GenerateRequest(
        text="Tell me a long story", stream=True,
        sampling_params=pb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
    )
    short = pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(max_tokens=2))
    quota = idle_server.admission.registry.quotas["solo"]
    with grpc.insecure_channel(idle_server.grpc_target, options=STALLED_CLIENT) as stalled, \
            grpc.insecure_channel(idle_server.grpc_target) as channel:
        call = pb_grpc.GenerationStub(stalled).Generate(long, metadata=solo)
        next(call)  # running; from here on the client reads nothing
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as busy:
            list(stub.Generate(short, metadata=solo, timeout=60))
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # its one slot
        wait_for(lambda: quota.running == 0, timeout=120)  # 20 s to finish: not on its own
        assert idle_server.admission.running == {}
        done = list(stub.Generate(short, metadata=solo, timeout=60))
        assert done[-1].final.usage.completion_tokens == 2
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:  # what the server had sent, then the status
                pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert info.value.details().startswith(
        f"the client read nothing for {IDLE_S:g}s (gateway.grpc_stream_idle_timeout_s) and "
        "the request was aborted after "
    )
    stats = wait_until_idle(loop_thread, backend, timeout=60)
    assert stats.kv_blocks_leaked == 0
    assert all(w.num_free_blocks == w.num_total_blocks for w in stats.workers)
