"""Health that means it: NOT_SERVING / 503 while a phase has no live worker, SERVING again once
the worker is back, and requests served after it."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bucketserve import Client, SamplingParams
from bucketserve.bucket_manager.config import TenantConfig
from tests.gateway.conftest import local_controller_config, start_server, wait_for

SERVING, NOT_SERVING = (
    health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
)


def http_health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def grpc_health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status


def test_a_dead_decode_worker_flips_health_until_it_is_back(
    loop_thread: Any, tiny_model_dir: Path
) -> None:
    from bucketserve.controller.controller import Controller

    config = local_controller_config(tiny_model_dir, [TenantConfig(name="default")])
    controller = loop_thread.call(lambda: Controller(config))
    loop_thread.run(controller.start())
    server = start_server(loop_thread, controller)
    try:
        assert http_health(server.http_url) == 200
        assert grpc_health(server.grpc_target) == SERVING
        released = loop_thread.call(asyncio.Event)
        revive = controller.pool.revive

        async def held_revive(handle: Any) -> None:  # keep the worker down until we looked
            await released.wait()
            await revive(handle)

        controller.pool.revive = held_revive
        loop_thread.run(controller.kill_worker("decode-0"))
        wait_for(lambda: http_health(server.http_url) == 503)
        wait_for(lambda: grpc_health(server.grpc_target) == NOT_SERVING)
        loop_thread.loop.call_soon_threadsafe(released.set)
        wait_for(lambda: http_health(server.http_url) == 200, timeout=30)
        wait_for(lambda: grpc_health(server.grpc_target) == SERVING)
        with Client(server.grpc_target) as client:
            out = client.generate("Hello", SamplingParams(temperature=0, max_tokens=4))
        assert out.finish_reason == "length" and len(out.token_ids) == 4
        stats = loop_thread.run(controller.drain(30), timeout=40)
        assert stats.kv_blocks_leaked == 0 and stats.worker("decode-0").restarts == 1
    finally:
        loop_thread.run(server.stop(0))
        loop_thread.run(controller.shutdown())
