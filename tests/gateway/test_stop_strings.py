"""Stop strings over gRPC: the controller's output processor ends the request at the stop
string (without its text), aborts it on the decode worker, which stops computing it long
before its max_tokens, and frees its blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bucketserve import Client, SamplingParams
from bucketserve.runtime.engine.llm import LLM
from tests.gateway.abort_checks import assert_stopped_early, decode_steps, slow_decode_steps
from tests.gateway.conftest import BLOCK_SIZE

PROMPT = "Once upon a time"
LONG = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
MAX_TOKENS = 400  # the request's own: prompt + output within the tiny model's 512


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    llm = LLM(str(tiny_model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64)
    return llm.generate([PROMPT], LONG, use_tqdm=False)[0]


def test_grpc_stop_string_ends_output_without_it_and_stops_the_worker(
    open_server: Any, backend: Any, loop_thread: Any, reference: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stop = reference.text[len(reference.text) // 2 :][:3]
    cut = reference.text.index(stop)
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop]
    )
    slow_decode_steps(backend, monkeypatch)
    before = decode_steps(loop_thread, backend)
    with Client(open_server.grpc_target) as client:
        chunks = list(client.stream(PROMPT, params))
    tokens = [t for c in chunks for t in c.token_ids]
    assert "".join(c.text for c in chunks) == reference.text[:cut]
    assert chunks[-1].finish_reason == "stop"
    assert tokens == reference.token_ids[: len(tokens)]
    assert len(tokens) < len(reference.token_ids)  # nothing past the stop string
    assert_stopped_early(loop_thread, backend, before, MAX_TOKENS)
