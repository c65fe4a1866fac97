"""The gRPC API through the SDK and raw stubs, against the real backend in local mode."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from bucketserve import (
    AsyncClient,
    AuthenticationError,
    Client,
    DeadlineExceededError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SamplingParams,
)
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2_grpc as pb_grpc
from bucketserve.runtime.engine.llm import LLM
from tests.gateway.abort_checks import slow_decode_steps
from tests.gateway.conftest import BLOCK_SIZE, fresh_stats, wait_until_idle

GREEDY = SamplingParams(temperature=0, max_tokens=12)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4"]
CHAT = [{"role": "user", "content": "What is a KV cache?"}]


@pytest.fixture(scope="module")
def engine_llm(tiny_model_dir: Path) -> LLM:
    """The in-process engine the service's output must equal."""
    return LLM(str(tiny_model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64)


@pytest.fixture
def client(open_server: Any) -> Any:
    with Client(open_server.grpc_target) as client:
        yield client


def key(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {name}-key"),)


def test_sdk_streams_what_the_in_process_engine_generates(client: Client, engine_llm: LLM) -> None:
    expected = engine_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        chunks = list(client.stream(prompt, GREEDY))
        assert sum(1 for c in chunks if c.token_ids) >= 2  # streamed, not one lump
        assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == want.token_ids
        assert "".join(c.text for c in chunks) == want.text
        final = chunks[-1]
        assert final.finish_reason == want.finish_reason.value
        assert (final.prompt_tokens, final.completion_tokens) == (
            len(want.prompt_token_ids), len(want.token_ids),
        )
        assert final.request_bucket is not None and final.timings is not None
        assert final.request_bucket[0] <= final.prompt_tokens < final.request_bucket[1]


def test_generate_chat_and_async_client_agree_with_the_engine(
    open_server: Any, client: Client, engine_llm: LLM
) -> None:
    want = engine_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
    want_chat = engine_llm.chat(CHAT, GREEDY, use_tqdm=False)[0]
    done = client.generate(PROMPTS[0], GREEDY)
    assert (done.token_ids, done.text) == (want.token_ids, want.text)
    chat = client.chat(CHAT, GREEDY)
    assert (chat.token_ids, chat.text) == (want_chat.token_ids, want_chat.text)

    async def use_async_client() -> tuple[Any, list[int]]:
        async with AsyncClient(open_server.grpc_target) as aclient:
            whole = await aclient.chat(CHAT, GREEDY)
            streamed = [t async for c in aclient.stream(PROMPTS[0], GREEDY) for t in c.token_ids]
            return whole, streamed

    whole, streamed = asyncio.run(use_async_client())
    assert whole.token_ids == want_chat.token_ids
    assert streamed == want.token_ids


def test_token_id_prompt_and_seeded_sampling_are_reproducible(client: Client) -> None:
    ids = [1, 504, 3458, 314]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10)
    first = client.generate(ids, sampled)
    assert first.prompt_tokens == 4
    assert client.generate(ids, sampled).token_ids == first.token_ids


def test_model_info_names_model_limits_and_tenant(open_server: Any, tenant_server: Any) -> None:
    with Client(open_server.grpc_target) as client:
        info = client.model_info()
    assert (info.max_model_len, info.block_size, info.vocab_size) == (512, BLOCK_SIZE, 49152)
    assert (info.model, info.tenant) == (open_server.model_name, "default")
    with Client(tenant_server.grpc_target, api_key="bob-key") as client:
        assert client.model_info().tenant == "bob"
    with Client(tenant_server.grpc_target) as client, pytest.raises(AuthenticationError):
        client.model_info()


def test_client_cancel_mid_stream_frees_the_blocks(
    loop_thread: Any, backend: Any, client: Client
) -> None:
    cancelled = fresh_stats(loop_thread, backend).finish_reasons.get("cancelled", 0)
    stream = client.stream("Tell me a long story", LONG)
    seen = [next(stream), next(stream)]
    assert all(c.token_ids and not c.finished for c in seen)
    decode = [w for w in fresh_stats(loop_thread, backend).workers if w.role == "decode"]
    assert any(w.num_free_blocks < w.num_total_blocks for w in decode)
    stream.close()  # leaving the loop early cancels the RPC
    stats = wait_until_idle(loop_thread, backend, timeout=10)
    assert stats.finish_reasons["cancelled"] == cancelled + 1  # aborted, not run to its end
    assert all(w.num_free_blocks == w.num_total_blocks for w in stats.workers)
    assert stats.running == 0 and stats.waiting == 0


def test_abort_rpc_ends_the_stream_cancelled_and_frees_blocks(
    loop_thread: Any, backend: Any, client: Client
) -> None:
    stream = client.stream("Tell me a long story", LONG, request_id="to-abort")
    first = next(stream)
    assert first.request_id == "to-abort"
    assert client.abort("to-abort") is True
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "cancelled"
    assert sum(len(c.token_ids) for c in [first, *rest]) < LONG.max_tokens
    assert client.abort("to-abort") is False
    stats = wait_until_idle(loop_thread, backend)
    assert all(w.num_free_blocks == w.num_total_blocks for w in stats.workers)


def test_abort_of_another_tenants_request_is_permission_denied(tenant_server: Any) -> None:
    target = tenant_server.grpc_target
    with Client(target, api_key="alice-key") as alice, Client(target, api_key="bob-key") as bob:
        stream = alice.stream("Tell me a long story", LONG, request_id="alice-1")
        next(stream)
        with pytest.raises(PermissionDeniedError, match="another tenant"):
            bob.abort("alice-1")
        assert next(stream).request_id == "alice-1"  # still running
        assert alice.abort("alice-1") is True
        assert list(stream)[-1].finish_reason == "cancelled"


def test_deadline_exceeded_aborts_and_frees_blocks(
    loop_thread: Any, backend: Any, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slowed decode steps make LONG take 20 s; its 3 s deadline leaves a loaded machine
    time to admit it (it runs, then is cancelled)."""
    slow_decode_steps(backend, monkeypatch)
    cancelled = fresh_stats(loop_thread, backend).finish_reasons.get("cancelled", 0)
    with pytest.raises(DeadlineExceededError):
        for _ in client.stream("Tell me a long story", LONG, timeout=3.0):
            pass
    stats = wait_until_idle(loop_thread, backend, timeout=60)
    assert stats.finish_reasons["cancelled"] == cancelled + 1
    assert all(w.num_free_blocks == w.num_total_blocks for w in stats.workers)


def test_tenant_over_its_concurrency_gets_resource_exhausted(tenant_server: Any) -> None:
    with Client(tenant_server.grpc_target, api_key="solo-key") as solo:
        first = solo.stream("Tell me a long story", LONG)
        request_id = next(first).request_id
        with pytest.raises(ResourceExhaustedError, match="max_concurrent_requests") as info:
            solo.generate("Hello", GREEDY)
        assert info.value.retry_after_s == 1.0
        assert solo.abort(request_id)
        list(first)
        assert solo.generate("Hello", GREEDY).finish_reason in ("stop", "length")


def test_tenant_over_its_token_rate_gets_resource_exhausted(tenant_server: Any) -> None:
    params = SamplingParams(temperature=0, max_tokens=25)
    with Client(tenant_server.grpc_target, api_key="metered-key") as metered:
        done = metered.generate("Hi", params)  # costs prompt + 25 of a 60-token burst
        assert done.completion_tokens == 25
        metered.generate("Hi", params)
        with pytest.raises(ResourceExhaustedError, match="token rate limit") as info:
            metered.generate("Hi", params)
        assert info.value.retry_after_s > 1.0


def raw_generate(target: str, request: pb.GenerateRequest, metadata: Any = ()) -> list[Any]:
    with grpc.insecure_channel(target) as channel:
        return list(pb_grpc.GenerationStub(channel).Generate(request, metadata=metadata))


def with_unknown_field(request: pb.GenerateRequest) -> bytes:
    return request.SerializeToString() + bytes([(99 << 3) & 0x7F | 0x80, 99 >> 4]) + b"\x01"


def sp(**kwargs: Any) -> pb.SamplingParams:
    return pb.SamplingParams(**{"max_tokens": 4, **kwargs})


BAD_REQUESTS = [
    # (request, metadata key, status, words in the message)
    (pb.GenerateRequest(text="", sampling_params=sp()), "alice", "INVALID_ARGUMENT", "empty"),
    (pb.GenerateRequest(sampling_params=sp()), "alice", "INVALID_ARGUMENT", "exactly one"),
    (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 600), sampling_params=sp()),
        "alice", "INVALID_ARGUMENT", "max_model_len",
    ),
    (  # the count is checked before any id: out-of-range ids past the length say "length"
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**6] * 600), sampling_params=sp()),
        "alice", "INVALID_ARGUMENT", "the prompt has 600 tokens but this service admits",
    ),
    (
        pb.GenerateRequest(text="Hi", sampling_params=sp(stop_token_ids=[10**6] * 300)),
        "alice", "INVALID_ARGUMENT",
        "stop_token_ids has 300 ids; this server takes at most 256 (gateway.max_stop_token_ids)",
    ),
    (
        pb.GenerateRequest(text="Hi", sampling_params=sp(max_tokens=600)),
        "alice", "INVALID_ARGUMENT", "lower max_tokens to at most",
    ),
    (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 49152]), sampling_params=sp()),
        "alice", "INVALID_ARGUMENT", "[0, 49152)",
    ),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(temperature=-1)), "alice",
     "INVALID_ARGUMENT", "temperature must be in [0, 100]"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(top_p=0)), "alice",
     "INVALID_ARGUMENT", "top_p must be in (0, 1]"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(max_tokens=0)), "alice",
     "INVALID_ARGUMENT", "max_tokens must be an integer >= 1"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(top_k=-3)), "alice",
     "INVALID_ARGUMENT", "top_k"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(stop_token_ids=[-1])), "alice",
     "INVALID_ARGUMENT", "stop_token_ids"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(seed=-4)), "alice",
     "INVALID_ARGUMENT", "seed"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(presence_penalty=2.5)), "alice",
     "INVALID_ARGUMENT", "presence_penalty must be in [-2, 2], got 2.5"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(frequency_penalty=-2.5)), "alice",
     "INVALID_ARGUMENT", "frequency_penalty must be in [-2, 2], got -2.5"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(repetition_penalty=0)), "alice",
     "INVALID_ARGUMENT", "repetition_penalty must be in (0, 2], got 0.0"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(min_p=1.5)), "alice",
     "INVALID_ARGUMENT", "min_p must be in [0, 1], got 1.5"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(min_tokens=5)), "alice",
     "INVALID_ARGUMENT", "min_tokens must be an integer in [0, max_tokens=4], got 5"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(logprobs=21)), "alice",
     "INVALID_ARGUMENT",
     "logprobs is 21; this server returns at most 20 top logprobs per token "
     "(gateway.max_logprobs)"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(n=0)), "alice",
     "INVALID_ARGUMENT", "n must be an integer in [1, 16], got 0"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(n=17)), "alice",
     "INVALID_ARGUMENT",
     "n is 17; this server samples at most 16 choices per request (gateway.max_n)"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(prompt_logprobs=21)), "alice",
     "INVALID_ARGUMENT",
     "prompt_logprobs is 21; this server returns at most 20 top logprobs per token "
     "(gateway.max_logprobs)"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(stop=["s"] * 65)), "alice",
     "INVALID_ARGUMENT",
     "stop has 65 strings; this server takes at most 64 (gateway.max_stop_strings)"),
    (
        pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="robot")])),
        "alice", "INVALID_ARGUMENT", "role must be one of",
    ),
    (pb.GenerateRequest(chat=pb.ChatMessages()), "alice", "INVALID_ARGUMENT", "messages is empty"),
    (pb.GenerateRequest(text="Hi", ttft_slo_s=-1), "alice", "INVALID_ARGUMENT", "ttft_slo_s"),
    (pb.GenerateRequest(text="Hi", request_id="x" * 200), "alice", "INVALID_ARGUMENT", "128"),
    (pb.GenerateRequest(text="Hi", sampling_params=sp(max_tokens=100)), "metered",
     "INVALID_ARGUMENT", "may use at most 60"),
    (pb.GenerateRequest(text="Hi"), None, "UNAUTHENTICATED", "needs an API key"),
    (pb.GenerateRequest(text="Hi"), "mallory", "UNAUTHENTICATED", "not valid"),
]


@pytest.mark.parametrize(("request_", "tenant", "status", "words"), BAD_REQUESTS)
def test_bad_input_gets_its_status_and_leaves_no_state(
    loop_thread: Any,
    backend: Any,
    tenant_server: Any,
    request_: pb.GenerateRequest,
    tenant: str | None,
    status: str,
    words: str,
) -> None:
    admission = tenant_server.admission
    before = {n: (q.running, q.bucket.level if q.bucket else None)
              for n, q in admission.registry.quotas.items()}
    metadata = key(tenant) if tenant else ()
    with pytest.raises(grpc.RpcError) as info:
        raw_generate(tenant_server.grpc_target, request_, metadata)
    assert info.value.code().name == status
    assert words in info.value.details()
    assert admission.running == {}
    after = {n: (q.running, q.bucket.level if q.bucket else None)
             for n, q in admission.registry.quotas.items()}
    assert {n: v[0] for n, v in after.items()} == {n: v[0] for n, v in before.items()}
    assert after["metered"][1] <= 60 and after["metered"][1] >= before["metered"][1]
    stats = loop_thread.call(backend.stats)
    assert stats.waiting == 0
    good = pb.GenerateRequest(text="Hi", sampling_params=sp())
    ok = raw_generate(tenant_server.grpc_target, good, key("alice"))
    assert ok[-1].final.usage.completion_tokens == 4


def test_unknown_fields_in_binary_requests_are_ignored(
    tenant_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A client built from a newer .proto still gets served (proto3's norm)."""
    caplog.set_level(logging.DEBUG, logger="bucketserve.gateway.grpc_servicer")
    request = pb.GenerateRequest(text="Hi", sampling_params=sp())
    with grpc.insecure_channel(tenant_server.grpc_target) as channel:
        generate = channel.unary_stream(
            "/bucketserve.v1.Generation/Generate",
            request_serializer=with_unknown_field,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        responses = list(generate(request, metadata=key("alice")))
    assert responses[-1].final.usage.completion_tokens == 4
    assert "ignoring unknown fields ['GenerateRequest #99'] of a newer client" in caplog.messages


def test_resource_exhausted_carries_retry_info_and_the_old_trailer(tenant_server: Any) -> None:
    with Client(tenant_server.grpc_target, api_key="solo-key") as solo:
        first = solo.stream("Tell me a long story", LONG)
        request_id = next(first).request_id
        with pytest.raises(grpc.RpcError) as info:
            raw_generate(tenant_server.grpc_target, pb.GenerateRequest(text="Hi"), key("solo"))
        assert solo.abort(request_id)
        list(first)
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(err)
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert status.message == err.details()
    (detail,) = status.details
    retry = error_details_pb2.RetryInfo()
    assert detail.Unpack(retry)
    assert retry.retry_delay.ToNanoseconds() == 1_000_000_000
    assert ("retry-after", "1") in tuple(err.trailing_metadata())


def test_stream_false_sends_one_message(tenant_server: Any) -> None:
    request = pb.GenerateRequest(text="Hi", sampling_params=sp(temperature=0), stream=False)
    (only,) = raw_generate(tenant_server.grpc_target, request, key("alice"))
    assert len(only.token_ids) == 4 and only.final.usage.completion_tokens == 4
    assert only.final.finish_reason == pb.FINISH_REASON_LENGTH


def test_health_reports_serving(open_server: Any) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(open_server.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "bucketserve.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
