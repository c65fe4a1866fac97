"""A full queue is RESOURCE_EXHAUSTED with retry-after; no live workers is UNAVAILABLE."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from bucketserve import (
    Client,
    ResourceExhaustedError,
    RetryPolicy,
    SamplingParams,
    UnavailableError,
)
from bucketserve.bucket_manager.config import TenantConfig
from bucketserve.gateway.generate_input import GenerateInput
from tests.gateway.conftest import http_post, local_controller_config, start_server


@pytest.fixture(scope="module")
def small_service(loop_thread: Any, tiny_model_dir: Path) -> Any:
    """A controller whose queue holds one request."""
    from bucketserve.controller.controller import Controller

    config = local_controller_config(
        tiny_model_dir, [TenantConfig(name="default")], max_queued_requests=1
    )
    controller = loop_thread.call(lambda: Controller(config))
    loop_thread.run(controller.start())
    server = start_server(loop_thread, controller)
    yield controller, server
    loop_thread.run(server.stop(0))
    loop_thread.run(controller.shutdown())


def test_full_queue_is_resource_exhausted(loop_thread: Any, small_service: Any) -> None:
    """Two admissions in one loop tick (token-id prompts are admitted without leaving the
    loop), so the first is still queued when the second comes: the controller's queue
    bound (1) refuses it, and the gateway maps that to RESOURCE_EXHAUSTED with the
    controller's retry-after, leaving nothing behind."""
    controller, server = small_service
    admission = server.admission
    hi = GenerateInput(prompt_token_ids=[1, 504], sampling={"max_tokens": 2, "temperature": 0.0})

    async def two_at_once() -> tuple[list[Any], ResourceExhaustedError]:
        first = await admission.admit(hi, None)
        try:
            with pytest.raises(ResourceExhaustedError, match="queued") as info:
                await admission.admit(dataclasses.replace(hi), None)
            assert list(admission.running) == [first.request_id]
            assert admission.registry.quotas["default"].running == 1
            return [delta async for delta in first], info.value
        finally:
            await first.close()

    deltas, error = loop_thread.run(two_at_once())
    assert error.retry_after_s == 1.0 and error.code.name == "RESOURCE_EXHAUSTED"
    assert deltas[-1].finished and deltas[-1].num_output_tokens == 2
    assert admission.running == {} and admission.registry.quotas["default"].running == 0
    with Client(server.grpc_target) as client:  # and the next request is served
        assert client.generate("Hi", SamplingParams(max_tokens=3)).completion_tokens == 3
    assert loop_thread.run(controller.drain(10)).kv_blocks_leaked == 0


def test_no_workers_is_unavailable(loop_thread: Any, tiny_model_dir: Path) -> None:
    from bucketserve.controller.controller import Controller

    config = local_controller_config(tiny_model_dir, [TenantConfig(name="default")])
    controller = loop_thread.call(lambda: Controller(config))
    loop_thread.run(controller.start())
    server = start_server(loop_thread, controller)
    try:
        loop_thread.run(controller.shutdown())
        retry = RetryPolicy(max_attempts=2, initial_backoff_s=0.01)
        client = Client(server.grpc_target, retry=retry)
        with client, pytest.raises(UnavailableError, match="stopped"):
            client.generate("Hi")
        assert server.metrics.rejected.labels("UNAVAILABLE")._value.get() == 2
        status, body, _ = http_post(f"{server.http_url}/v1/completions", {"prompt": "Hi"})
        assert status == 503 and body["error"]["type"] == "service_unavailable_error"
        assert "stopped" in body["error"]["message"]
        assert server.admission.running == {}
    finally:
        loop_thread.run(server.stop(0))
