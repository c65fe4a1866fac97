"""The gateway over the controller with its workers as Ray actors (slow: starts Ray)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bucketserve import Client, SamplingParams
from bucketserve.bucket_manager.config import TenantConfig
from bucketserve.runtime.engine.llm import LLM
from tests.gateway.conftest import BLOCK_SIZE, local_controller_config, start_server, wait_for
from tests.gateway.test_health import NOT_SERVING, SERVING, grpc_health, http_health

GREEDY = SamplingParams(temperature=0, max_tokens=12)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.mark.slow
def test_sdk_through_ray_actors_matches_the_engine_and_cancel_frees_blocks(
    loop_thread: Any, tiny_model_dir: Path
) -> None:
    from bucketserve.controller.controller import Controller

    config = local_controller_config(
        tiny_model_dir, [TenantConfig(name="default")], mode="ray",
        ray_init_kwargs={"num_cpus": 2, "log_to_driver": False},
    )
    controller = loop_thread.call(lambda: Controller(config))
    loop_thread.run(controller.start(), timeout=300)
    server = start_server(loop_thread, controller)
    try:
        stats = loop_thread.call(controller.stats)
        assert sorted(w.role for w in stats.workers) == ["decode", "prefill"]
        assert all(w.node_id != "local" for w in stats.workers)  # real actors
        llm = LLM(str(tiny_model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64)
        want = llm.generate(["Hello, my name is"], GREEDY, use_tqdm=False)[0]
        with Client(server.grpc_target) as client:
            chunks = list(client.stream("Hello, my name is", GREEDY))
            assert [t for c in chunks for t in c.token_ids] == want.token_ids
            assert "".join(c.text for c in chunks) == want.text
            stream = client.stream("Tell me a long story", LONG)
            next(stream)
            stream.close()
        drained = loop_thread.run(controller.drain(30), timeout=60)
        assert drained.kv_blocks_leaked == 0 and drained.running == 0
        assert drained.finish_reasons == {"length": 1, "cancelled": 1}
        decode = [w for w in drained.workers if w.role == "decode"]
        assert [(w.num_free_blocks == w.num_total_blocks) for w in decode] == [True]

        # the decode actor's process killed: health says so until Ray has it back
        loop_thread.run(controller.kill_worker("decode-0"))
        wait_for(lambda: http_health(server.http_url) == 503)
        wait_for(lambda: grpc_health(server.grpc_target) == NOT_SERVING)
        wait_for(lambda: http_health(server.http_url) == 200, timeout=120)
        wait_for(lambda: grpc_health(server.grpc_target) == SERVING)
        with Client(server.grpc_target) as client:
            again = list(client.stream("Hello, my name is", GREEDY))
        assert [t for c in again for t in c.token_ids] == want.token_ids
    finally:
        loop_thread.run(server.stop(0))
        loop_thread.run(controller.shutdown(), timeout=120)
