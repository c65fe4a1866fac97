"""Who may read what: /metrics behind a tenant's key when gateway.metrics_auth is on, the
demo keys serve.yaml ships announced at start, and what is exposed on a network named."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.gateway.server import demo_key_warnings, exposure_warnings
from bucketserve.gateway.tenant_registry import TenantRegistry
from tests.gateway.conftest import http_post, start_server

SERVE_YAML = Path(__file__).resolve().parents[2] / "bucketserve" / "deploy" / "serve.yaml"


def get(url: str, key: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def served_for_alice(server: Any) -> None:
    """One request of tenant alice, so /metrics has her samples."""
    body = {"prompt": "Hi", "max_tokens": 1}
    auth = {"Authorization": "Bearer alice-key"}
    assert http_post(f"{server.http_url}/v1/completions", body, auth)[0] == 200


@pytest.fixture(scope="module")
def guarded_server(loop_thread: Any, backend: Any, tenant_registry: TenantRegistry) -> Any:
    server = start_server(loop_thread, backend, tenant_registry, metrics_auth=True)
    yield server
    loop_thread.run(server.stop(0))


def test_metrics_need_a_tenants_key_when_metrics_auth_is_on(guarded_server: Any) -> None:
    served_for_alice(guarded_server)
    url = f"{guarded_server.http_url}/metrics"
    for key in (None, "not-a-key"):
        status, body = get(url, key)
        assert status == 401
        error = json.loads(body)["error"]
        assert error["type"] == "authentication_error"
        assert "alice" not in body
    status, body = get(url, "alice-key")
    assert status == 200
    assert 'tenant="alice"' in body and "bucketserve:" in body
    assert get(f"{guarded_server.http_url}/health")[0] == 200  # health stays open


def test_metrics_are_open_by_default(tenant_server: Any) -> None:
    """The default (off), which the keyless embedded default needs; with tenants it shows
    them to anyone who reaches the port, as the key's reference says."""
    served_for_alice(tenant_server)
    status, body = get(f"{tenant_server.http_url}/metrics")
    assert status == 200 and 'tenant="alice"' in body


def test_the_shipped_demo_keys_are_announced_at_start(
    loop_thread: Any, backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    tenants = yaml.safe_load(SERVE_YAML.read_text())["tenants"]
    registry = TenantRegistry.from_dict(tenants)
    caplog.set_level(logging.WARNING, logger="bucketserve.gateway.server")
    server = start_server(loop_thread, backend, registry)
    loop_thread.run(server.stop(0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for tenant, key in (("interactive", "interactive-demo-key"), ("batch", "batch-demo-key")):
        (line,) = [w for w in warnings if f"tenant {tenant!r} accepts the demo API key" in w]
        assert f"{key!r}" in line
        assert "Replace the tenant's api_key_sha256 with the digest of a key of your own" in line


def test_own_keys_raise_no_demo_key_warning() -> None:
    registry = TenantRegistry.from_dict([
        {"name": "interactive", "api_keys": ["a-key-of-my-own"]},
        {"name": "batch", "api_keys": ["batch-demo-key", "another-key"]},
    ])
    (line,) = demo_key_warnings(registry)
    assert line.startswith("tenant 'batch' accepts the demo API key 'batch-demo-key'")
    assert demo_key_warnings(TenantRegistry()) == []


def test_open_metrics_on_a_network_are_named_at_start() -> None:
    tenants = TenantRegistry.from_dict([{"name": "a", "api_keys": ["k"]}])
    network = GatewayConfig(host="0.0.0.0")
    assert any("/metrics" in w and "gateway.metrics_auth" in w
               for w in exposure_warnings(network, tenants))
    guarded = GatewayConfig(host="0.0.0.0", metrics_auth=True)
    assert not any("/metrics" in w for w in exposure_warnings(guarded, tenants))
    assert exposure_warnings(GatewayConfig(), tenants) == []  # loopback
