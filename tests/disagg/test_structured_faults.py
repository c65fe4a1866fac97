"""A JSON-schema request whose worker dies mid-generation, through the OpenAI HTTP surface:
the request is prefilled again with what it streamed, its grammar rebuilt from those
tokens, and its reply is the fault-free one and validates against the schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from bucketserve.bucket_manager.config import TenantConfig
from tests.gateway.conftest import local_controller_config, start_server
from tests.gateway.loop_thread import LoopThread

# Bounded everywhere (string lengths, numbers, a fixed-length array, no free whitespace), so
# even the tiny random model's greedy reply ends well within MAX_TOKENS; the array makes it
# long enough for a kill to land mid-generation.
SCHEMA = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "age": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "events": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["login", "logout", "purchase"]},
                    "count": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["kind", "count"],
                "additionalProperties": False,
            },
            "minItems": 6,
            "maxItems": 6,
        },
    },
    "required": ["user", "role", "events"],
    "additionalProperties": False,
}
STRUCTURED = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
MESSAGES = [{"role": "user", "content": "Describe a user and their last six events as JSON."}]
MAX_TOKENS = 400
KILL_AFTER = 4  # content chunks streamed before the worker dies


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


def serve(loop_thread: LoopThread, model_dir: Path, topology: str) -> tuple[Any, Any]:
    """The gateway over a controller of `topology`; `<topology>-ray`: its workers Ray actors
    (a kill is then the actor's process dying)."""
    from bucketserve.controller.controller import Controller

    topology, _, ray = topology.partition("-")
    options: dict[str, Any] = {"topology": topology}
    if ray:
        options.update(mode="ray", ray_init_kwargs={"num_cpus": 2, "log_to_driver": False})
    config = local_controller_config(model_dir, [TenantConfig(name="default")], **options)
    controller = loop_thread.call(lambda: Controller(config))
    loop_thread.run(controller.start(), timeout=300)
    return start_server(loop_thread, controller), controller


def stream(server: Any, on_chunk: Any = None) -> tuple[str, str | None]:
    """The streamed reply's text and finish reason; `on_chunk(n)` after the n-th content
    chunk."""
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)
    parts, finish, n = [], None, 0
    for chunk in client.chat.completions.create(
        model=server.model_name, messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body=STRUCTURED,
    ):
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
                n += 1
                if on_chunk is not None:
                    on_chunk(n)
            finish = choice.finish_reason or finish
    return "".join(parts), finish


TOPOLOGIES = [
    "disaggregated", "colocated", pytest.param("disaggregated-ray", marks=pytest.mark.slow)
]


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_constrained_request_whose_worker_dies_still_validates(
    loop_thread: LoopThread, tiny_model_dir: Path, topology: str
) -> None:
    """The decode worker (disaggregated: re-prefilled on the prefill worker; colocated: on
    the restarted worker; Ray: its actor's process killed, Ray restarts it) killed once the
    reply has streamed KILL_AFTER chunks."""
    server, controller = serve(loop_thread, tiny_model_dir, topology)
    try:
        want, finish = stream(server)
        assert finish == "stop", want
        jsonschema.validate(json.loads(want), SCHEMA)

        def kill(n: int) -> None:
            if n == KILL_AFTER:
                loop_thread.run(controller.kill_worker("decode-0"))

        got, finish = stream(server, kill)
        stats = loop_thread.run(controller.drain(30), timeout=60)
    finally:
        loop_thread.run(server.stop(0))
        loop_thread.run(controller.shutdown(), timeout=120)
    assert stats.worker("decode-0").restarts == 1
    assert stats.requests_requeued == 1  # the kill landed mid-generation
    assert finish == "stop" and got == want
    jsonschema.validate(json.loads(got), SCHEMA)
    assert stats.kv_blocks_leaked == 0 and stats.leases_open == 0 and stats.running == 0
