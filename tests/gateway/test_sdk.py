"""The SDK's pieces that need no server: exports, status mapping, retries, results."""

from __future__ import annotations

import socket
import time

import grpc
import pytest

import bucketserve
from bucketserve import Chunk, Client, Completion, RetryPolicy, SamplingParams
from bucketserve.gateway.client_base import build_input
from bucketserve.gateway.errors import (
    AuthenticationError,
    BucketServeError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
    error_for_status,
)
from bucketserve.gateway.rich_status import retry_delay, status_trailers


def test_public_exports() -> None:
    for name in bucketserve.__all__:
        assert getattr(bucketserve, name) is not None
    assert bucketserve.SamplingParams is SamplingParams
    assert issubclass(bucketserve.InvalidArgumentError, bucketserve.BucketServeError)


@pytest.mark.parametrize(
    ("code", "cls", "http"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError, 400),
        (grpc.StatusCode.UNAUTHENTICATED, AuthenticationError, 401),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDeniedError, 403),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhaustedError, 429),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError, 504),
        (grpc.StatusCode.UNAVAILABLE, UnavailableError, 503),
        (grpc.StatusCode.INTERNAL, InternalError, 500),
    ],
)
def test_each_status_has_its_exception(code: grpc.StatusCode, cls: type, http: int) -> None:
    error = error_for_status(code, "what to change")
    assert type(error) is cls and error.code == code and error.http_status == http
    assert str(error) == "what to change"


def test_retry_after_and_unknown_status() -> None:
    error = error_for_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down", 2.5)
    assert isinstance(error, ResourceExhaustedError) and error.retry_after_s == 2.5
    other = error_for_status(grpc.StatusCode.DATA_LOSS, "lost")
    assert type(other) is BucketServeError and other.code == grpc.StatusCode.DATA_LOSS


def test_retry_policy_retries_only_unavailable_with_capped_backoff() -> None:
    policy = RetryPolicy(max_attempts=4, initial_backoff_s=0.1, max_backoff_s=0.3, jitter=0.0)
    unavailable = UnavailableError("down")
    assert [policy.should_retry(unavailable, a) for a in range(4)] == [True, True, True, False]
    assert not policy.should_retry(InvalidArgumentError("bad"), 0)
    assert [policy.backoff(a) for a in range(4)] == pytest.approx([0.1, 0.2, 0.3, 0.3])
    jittered = RetryPolicy(initial_backoff_s=1.0, max_backoff_s=1.0, jitter=0.5)
    assert all(0.5 <= jittered.backoff(0) <= 1.5 for _ in range(50))
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


def test_retry_delay_reads_retry_info_before_the_old_trailer() -> None:
    error = ResourceExhaustedError("slow down", 2.5)
    trailers = status_trailers(error)
    assert ("retry-after", "2.5") in trailers
    assert retry_delay(trailers) == 2.5
    assert retry_delay([("retry-after", "3")]) == 3.0  # an old server
    rich_only = [t for t in trailers if t[0] != "retry-after"]
    assert retry_delay(rich_only) == 2.5
    assert retry_delay(status_trailers(UnavailableError("down"))) is None


def test_retries_stop_at_the_calls_one_deadline() -> None:
    """Nothing listens on the port: every attempt is UNAVAILABLE at once. A policy that
    would retry for a minute gives up when the 0.5 s deadline would pass."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the client connects
    policy = RetryPolicy(max_attempts=1000, initial_backoff_s=0.05, max_backoff_s=0.05, jitter=0)
    with Client(f"127.0.0.1:{port}", retry=policy, timeout=0.5) as client:
        start = time.monotonic()
        with pytest.raises(UnavailableError):
            client.model_info()
        with pytest.raises(UnavailableError):
            client.generate("Hi")
        took = time.monotonic() - start
    # retried, for one deadline each (1 s for both), not 1000 x 0.05 s each (100 s): the
    # upper bound leaves a loaded machine room
    assert 0.6 < took < 20.0


def test_build_input_checks_types_before_sending() -> None:
    inp = build_input("Hi", None, SamplingParams(temperature=0, max_tokens=3), priority=2)
    assert (inp.prompt, inp.priority, inp.sampling["max_tokens"]) == ("Hi", 2, 3)
    assert build_input([1, 2]).prompt_token_ids == [1, 2]
    with pytest.raises(TypeError, match="SamplingParams"):
        build_input("Hi", None, {"temperature": 0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prompt must be"):
        build_input(3.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword"):
        build_input("Hi", colour="red")  # type: ignore[call-arg]


def test_completion_from_chunks() -> None:
    chunks = [
        Chunk("r", [1, 2], "ab"),
        Chunk("r", [3], "c", finished=True, finish_reason="stop", completion_tokens=3),
    ]
    done = Completion.from_chunks(chunks)
    assert (done.token_ids, done.text, done.finish_reason, done.completion_tokens) == (
        [1, 2, 3], "abc", "stop", 3
    )
    with pytest.raises(ValueError, match="without a final chunk"):
        Completion.from_chunks(chunks[:1])
