"""The SDK against the real SmolLM2 weights: its text equals the in-process engine's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bucketserve import Client, SamplingParams
from bucketserve.bucket_manager.config import TenantConfig
from tests.gateway.conftest import start_server

GREEDY = SamplingParams(temperature=0, max_tokens=24)
QUESTIONS = ["What is the capital of France?", "Name three colours."]


@pytest.mark.smollm
def test_sdk_text_equals_the_engine_on_smollm2(loop_thread: Any, smollm_dir: Path) -> None:
    from bucketserve.controller.config import ControllerConfig
    from bucketserve.controller.controller import Controller
    from bucketserve.deploy.serve_config import with_tenants
    from bucketserve.runtime.engine.llm import LLM
    from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

    runner = ModelRunnerConfig(model=str(smollm_dir), num_kv_blocks=64)
    config = ControllerConfig(runner=runner, mode="local")
    config = with_tenants(config, [TenantConfig(name="default")])
    controller = loop_thread.call(lambda: Controller(config))
    loop_thread.run(controller.start(), timeout=300)
    server = start_server(loop_thread, controller)
    try:
        conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
        with Client(server.grpc_target) as client:
            got = [client.chat(c, GREEDY) for c in conversations]
            streamed = list(client.chat_stream(conversations[0], GREEDY))
        want = LLM(str(smollm_dir), num_kv_blocks=64).chat(conversations, GREEDY, use_tqdm=False)
        assert [g.text for g in got] == [w.text for w in want]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert "Paris" in got[0].text
        assert "".join(c.text for c in streamed) == want[0].text
        assert sum(1 for c in streamed if c.token_ids) > 1
    finally:
        loop_thread.run(server.stop(0))
        loop_thread.run(controller.shutdown())
