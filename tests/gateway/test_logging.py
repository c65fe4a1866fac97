"""The access log (one line per request, HTTP and gRPC), the JSON-lines format, the
`serve` logging flags, and the warning when serving a network unprotected."""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc
import pytest

from bucketserve import Client, SamplingParams
from bucketserve.cli import main
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.gateway.log_setup import JsonLines, configure_logging
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2_grpc as pb_grpc
from bucketserve.gateway.server import exposure_warnings
from bucketserve.gateway.tenant_registry import TenantRegistry
from tests.gateway.conftest import http_post, start_server, wait_for


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if r.name == "bucketserve.access"]


def test_http_requests_get_one_access_line_each(
    open_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="bucketserve.access")
    url = f"{open_server.http_url}/v1/completions"
    status, body, _ = http_post(url, {"prompt": "A secret prompt", "max_tokens": 3})
    assert status == 200
    status, _, _ = http_post(url, {"prompt": "A secret prompt", "max_tokens": 0})
    assert status == 400
    wait_for(lambda: len(access_lines(caplog)) == 2)
    ok, bad = access_lines(caplog)
    assert ok["route"] == "POST /v1/completions" and ok["status"] == 200
    assert (ok["tenant"], ok["finish"]) == ("default", "length")
    assert ok["request_id"] == body["id"].removeprefix("cmpl-")
    assert (ok["prompt_tokens"], ok["output_tokens"]) == (body["usage"]["prompt_tokens"], 3)
    assert 0 < ok["ttft_ms"] <= ok["total_ms"]
    assert bad == {"route": "POST /v1/completions", "status": 400, "tenant": "default",
                   "total_ms": bad["total_ms"]}
    assert all("secret" not in r.getMessage() for r in caplog.records)


def test_grpc_calls_get_one_access_line_each(
    open_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="bucketserve.access")
    with Client(open_server.grpc_target) as client:
        done = client.generate("Hi", SamplingParams(temperature=0, max_tokens=2))
    with grpc.insecure_channel(open_server.grpc_target) as channel, pytest.raises(grpc.RpcError):
        list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(text="")))
    wait_for(lambda: len(access_lines(caplog)) == 2)
    ok, bad = access_lines(caplog)
    assert (ok["route"], ok["status"], ok["tenant"]) == ("grpc Generate", "OK", "default")
    assert (ok["request_id"], ok["output_tokens"]) == (done.request_id, 2)
    assert (bad["status"], bad["tenant"]) == ("INVALID_ARGUMENT", None)


def test_prompts_are_logged_only_when_asked(
    loop_thread: Any, backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="bucketserve.access")
    server = start_server(loop_thread, backend, log_prompts=True)
    try:
        status, _, _ = http_post(
            f"{server.http_url}/v1/completions", {"prompt": "Say hi", "max_tokens": 1}
        )
        assert status == 200
        wait_for(lambda: len(access_lines(caplog)) == 1)
    finally:
        loop_thread.run(server.stop(0))
    (line,) = access_lines(caplog)
    assert line["prompt"] == "Say hi"
    assert caplog.records[-1].getMessage().endswith(" prompt='Say hi'")


def test_json_lines_carry_time_level_logger_message_and_fields() -> None:
    record = logging.LogRecord("bucketserve.access", logging.INFO, __file__, 1, "%s", ("x",),
                               None)
    record.fields = {"status": 200, "tenant": "alice"}
    out = json.loads(JsonLines().format(record))
    assert set(out) == {"time", "level", "logger", "message", "status", "tenant"}
    assert (out["level"], out["logger"], out["message"]) == ("INFO", "bucketserve.access", "x")
    assert out["time"].endswith("+00:00") and "T" in out["time"]


def test_configure_logging_sets_the_level_and_replaces_handlers() -> None:
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    try:
        configure_logging("debug", json_lines=True)
        configure_logging("warning")
        assert root.level == logging.WARNING
        (handler,) = root.handlers
        assert "%(asctime)s" in handler.formatter._fmt  # timestamps
        with pytest.raises(ValueError, match="--log-level must be one of"):
            configure_logging("loud")
    finally:
        root.handlers[:] = saved[1]
        root.setLevel(saved[0])


def test_serve_takes_log_level_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--log-level", "loud"])
    assert "invalid choice: 'loud'" in capsys.readouterr().err


def test_binding_a_network_without_tenants_or_tls_warns() -> None:
    open_network = exposure_warnings(GatewayConfig(host="0.0.0.0"), TenantRegistry())
    assert open_network == [
        "serving 0.0.0.0 without tenants: anyone who reaches this address can generate, "
        "with no API key; configure tenants (their api_key_sha256) to require one",
        "serving 0.0.0.0 without TLS: prompts, outputs and API keys cross the network in "
        "clear text; set gateway.tls_cert_file and gateway.tls_key_file",
    ]
    tenants = TenantRegistry.from_dict([{"name": "a", "api_keys": ["k"]}])
    assert [w.split(":")[0] for w in exposure_warnings(GatewayConfig(host="10.0.0.5"),
                                                       tenants)] == [
        "serving 10.0.0.5 without TLS", "serving /metrics on 10.0.0.5 without a key"
    ]
    for host in ("127.0.0.1", "::1", "localhost"):
        assert exposure_warnings(GatewayConfig(host=host), TenantRegistry()) == []
