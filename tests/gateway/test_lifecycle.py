"""Shutdown drains, UNAVAILABLE is retried, TLS from config, message size limits."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bucketserve import (
    Client,
    ResourceExhaustedError,
    RetryPolicy,
    SamplingParams,
    UnavailableError,
)
from bucketserve.gateway.gateway_config import BindError
from tests.gateway.conftest import start_server, wait_for, wait_until_idle

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)


def test_shutdown_drains_then_cancels_with_a_final_message(loop_thread: Any, backend: Any) -> None:
    server = start_server(loop_thread, backend)
    with Client(server.grpc_target, retry=FAST_RETRY) as client:
        stream = client.stream("Tell me a long story", LONG)
        next(stream)
        stopping = asyncio.run_coroutine_threadsafe(server.stop(30.0), loop_thread.loop)
        wait_for(lambda: server.admission.draining)
        with grpc.insecure_channel(server.grpc_target) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(UnavailableError, match="shutting down"):
            client.generate("Hi", SamplingParams(max_tokens=2))
        rejected = server.metrics.rejected.labels("UNAVAILABLE")._value.get()
        assert rejected == FAST_RETRY.max_attempts  # retried, then given up
        loop_thread.call(server.admission.hurry)
        final = list(stream)[-1]
        assert (final.finish_reason, final.error) == ("cancelled", "the server is shutting down")
        assert stopping.result(30) == 1
    stats = wait_until_idle(loop_thread, backend)
    assert all(w.num_free_blocks == w.num_total_blocks for w in stats.workers)


def test_shutdown_lets_short_requests_finish(loop_thread: Any, backend: Any) -> None:
    server = start_server(loop_thread, backend)
    with Client(server.grpc_target) as client:
        stream = client.stream("Hi", SamplingParams(temperature=0, max_tokens=30))
        next(stream)
        stopping = asyncio.run_coroutine_threadsafe(server.stop(30.0), loop_thread.loop)
        final = list(stream)[-1]
        assert final.finish_reason == "length" and final.completion_tokens == 30
        assert stopping.result(30) == 0


def test_oversized_message_is_refused(loop_thread: Any, backend: Any) -> None:
    server = start_server(loop_thread, backend, max_message_bytes=4096)
    try:
        with Client(server.grpc_target) as client:
            with pytest.raises(ResourceExhaustedError, match="larger than max"):
                client.generate("word " * 2000)
            assert client.generate("Hi", SamplingParams(max_tokens=2)).completion_tokens == 2
    finally:
        loop_thread.run(server.stop(0))


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    out = tmp_path_factory.mktemp("tls")
    cert, key = out / "cert.pem", out / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


def test_tls_from_config(loop_thread: Any, backend: Any, certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    server = start_server(loop_thread, backend, tls_cert_file=str(cert), tls_key_file=str(key))
    try:
        assert server.http_url is not None and server.http_url.startswith("https://")
        with Client(server.grpc_target, root_certificates=cert.read_bytes()) as client:
            assert client.generate("Hi", SamplingParams(max_tokens=3)).completion_tokens == 3
        plain = Client(server.grpc_target, timeout=5, retry=RetryPolicy(max_attempts=1))
        with plain, pytest.raises(UnavailableError):
            plain.generate("Hi")
        context = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"{server.http_url}/health", context=context) as response:
            assert response.status == 200
    finally:
        loop_thread.run(server.stop(0))


def test_a_taken_http_port_is_a_clear_error_naming_the_key_and_flag(
    loop_thread: Any, backend: Any, open_server: Any
) -> None:
    taken = open_server.http.port
    with pytest.raises(BindError, match=rf":{taken}: address already in use\. .*--http-port"):
        start_server(loop_thread, backend, http_port=taken)
    with urllib.request.urlopen(f"{open_server.http_url}/health", timeout=10) as reply:
        assert reply.status == 200  # the running server is untouched
