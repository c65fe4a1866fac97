"""n > 1 through the service, in both deployment topologies: one request whose samples share
the prompt's KV blocks (prefilled once), over the real `openai` client and the gRPC SDK;
echo with the prompt's logprobs (checked against transformers); every block free after."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from bucketserve import Client
from bucketserve.bucket_manager.config import TenantConfig
from bucketserve.gateway.cli import run_generate
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.engine.llm import LLM
from tests.gateway.abort_checks import assert_stopped_early, decode_steps, slow_decode_steps
from tests.gateway.conftest import (
    BLOCK_SIZE,
    local_controller_config,
    start_server,
    wait_until_idle,
)

PROMPT = "Once upon a time there was a paged KV cache that"
MAX_TOKENS = 200  # 4 samples of it fill most of the 256-block pool: no preemption


@pytest.fixture(scope="module")
def engine_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64)


@pytest.fixture(scope="module")
def colocated(loop_thread: Any, tiny_model_dir: Path) -> Iterator[tuple[Any, Any]]:
    from bucketserve.controller.controller import Controller

    config = local_controller_config(
        tiny_model_dir, [TenantConfig(name="default")], topology="colocated"
    )
    controller = loop_thread.call(lambda: Controller(config))
    loop_thread.run(controller.start())
    server = start_server(loop_thread, controller)
    yield controller, server
    loop_thread.run(server.stop(0))
    loop_thread.run(controller.shutdown())


@pytest.fixture(params=["disaggregated", "colocated"])
def service(request: Any, backend: Any, open_server: Any) -> tuple[Any, Any]:
    if request.param == "disaggregated":
        return backend, open_server
    return request.getfixturevalue("colocated")


def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)


def local(llm: LLM, **params: Any) -> Any:
    return llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0]


def test_greedy_n3_gives_three_copies_of_the_single_output(
    service: Any, engine_llm: LLM, loop_thread: Any
) -> None:
    backend, server = service
    want = local(engine_llm, temperature=0, max_tokens=10)
    out = oai(server).completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=10, temperature=0, n=3
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [want.text] * 3
    assert [c.finish_reason for c in out.choices] == ["length"] * 3
    assert out.usage.completion_tokens == 30
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)
    assert wait_until_idle(loop_thread, backend).kv_blocks_leaked == 0


def test_seeded_n3_equals_single_requests_seeded_s_s1_s2(
    service: Any, loop_thread: Any
) -> None:
    backend, server = service
    client = oai(server)
    common = {"model": server.model_name, "prompt": PROMPT, "max_tokens": 12,
              "temperature": 1.0}
    singles = [client.completions.create(**common, seed=40 + i).choices[0].text for i in range(3)]
    assert len(set(singles)) > 1
    out = client.completions.create(**common, seed=40, n=3)
    assert [c.text for c in out.choices] == singles
    chunks = list(client.completions.create(**common, seed=40, n=3, stream=True))
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == singles
    assert wait_until_idle(loop_thread, backend).kv_blocks_leaked == 0


def test_the_samples_share_the_prompt_blocks_on_the_decode_worker(
    service: Any, loop_thread: Any
) -> None:
    backend, server = service
    bm = backend.pool.role("decode")[0].worker.engine.block_manager
    shared_seen = threading.Event()
    prompt_ids = list(range(100, 140))  # 40 tokens: 9 full blocks of 4 before the last one

    def watch() -> None:
        while not shared_seen.is_set():
            if sum(bm.ref_count(b) == 3 for b in range(bm.num_total_blocks)) == 9:
                shared_seen.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out = oai(server).completions.create(
        model=server.model_name, prompt=prompt_ids, max_tokens=40, temperature=0.7,
        n=3, extra_body={"ignore_eos": True},
    )
    shared_seen.set()
    watcher.join()
    assert len(out.choices) == 3 and all(c.finish_reason == "length" for c in out.choices)
    assert wait_until_idle(loop_thread, backend).kv_blocks_leaked == 0


def test_a_stop_string_ends_each_sample_on_its_own(
    service: Any, engine_llm: LLM, loop_thread: Any
) -> None:
    backend, server = service
    whole = local(engine_llm, temperature=0, max_tokens=16)
    stop = whole.text[len(whole.text) // 2 :][:3]
    want = local(engine_llm, temperature=0, max_tokens=16, stop=[stop])
    assert want.outputs[0].finish_reason.value == "stop"
    out = oai(server).completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=16, temperature=0, n=3, stop=[stop]
    )
    assert [c.text for c in out.choices] == [want.text] * 3
    assert [c.finish_reason for c in out.choices] == ["stop"] * 3
    assert wait_until_idle(loop_thread, backend).kv_blocks_leaked == 0


def test_abort_mid_generation_stops_the_samples_on_the_worker(
    service: Any, loop_thread: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, server = service
    slow_decode_steps(backend, monkeypatch)
    before = decode_steps(loop_thread, backend)
    stream = oai(server).completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.8, n=4,
        stream=True, extra_body={"ignore_eos": True},
    )
    seen = 0
    for chunk in stream:
        seen += len(chunk.choices)
        if seen >= 12:
            break
    stream.close()
    assert_stopped_early(loop_thread, backend, before, MAX_TOKENS)


@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_model_dir: Path, engine_llm: LLM) -> tuple[list[int], Any]:
    from transformers import AutoModelForCausalLM

    ids = engine_llm.tokenizer.encode(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return ids, torch.log_softmax(logits.float(), dim=-1)


def test_echo_with_logprobs_gives_the_prompt_logprobs(
    service: Any, engine_llm: LLM, hf_prompt_logprobs: Any, loop_thread: Any
) -> None:
    backend, server = service
    ids, ref = hf_prompt_logprobs
    want = local(engine_llm, temperature=0, max_tokens=5, logprobs=2)
    client = oai(server)
    common = {"model": server.model_name, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
              "echo": True, "logprobs": 2}
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(**common, stream=True))
            token_logprobs, tops, text = [], [], ""
            for chunk in chunks:
                for choice in chunk.choices:
                    text += choice.text
                    if choice.logprobs is not None:
                        token_logprobs += choice.logprobs.token_logprobs
                        tops += choice.logprobs.top_logprobs
        else:
            choice = client.completions.create(**common).choices[0]
            text = choice.text
            token_logprobs, tops = choice.logprobs.token_logprobs, choice.logprobs.top_logprobs
        assert text == PROMPT + want.text
        assert len(token_logprobs) == len(ids) + 5
        assert token_logprobs[0] is None and tops[0] is None  # OpenAI: the first has none
        for pos in range(1, len(ids)):
            assert token_logprobs[pos] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-3)
            assert len(tops[pos]) in (2, 3)  # the top 2 and the prompt token itself
        outputs = token_logprobs[len(ids):]
        assert outputs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-3)
    assert wait_until_idle(loop_thread, backend).kv_blocks_leaked == 0


def test_grpc_sdk_n_and_prompt_logprobs(
    service: Any, engine_llm: LLM, hf_prompt_logprobs: Any, loop_thread: Any
) -> None:
    backend, server = service
    ids, ref = hf_prompt_logprobs
    want = local(engine_llm, temperature=0, max_tokens=6)
    with Client(server.grpc_target) as client:
        done = client.generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=6, n=3, prompt_logprobs=1)
        )
        assert [s.index for s in done.choices] == [0, 1, 2]
        assert [s.token_ids for s in done.choices] == [want.token_ids] * 3
        assert [s.finish_reason for s in done.choices] == ["length"] * 3
        assert done.completion_tokens == 18
        assert len(done.prompt_logprobs) == len(ids) and done.prompt_logprobs[0] is None
        last = done.prompt_logprobs[-1]
        assert last.logprob == pytest.approx(ref[-2, ids[-1]].item(), abs=1e-3)
        assert [t for t, _ in last.top] == [ref[-2].argmax().item()]
        chunks = list(client.stream(
            PROMPT, SamplingParams(temperature=1.0, seed=7, max_tokens=6, n=2)
        ))
        by_index: dict[int, list[int]] = {0: [], 1: []}
        for chunk in chunks:
            by_index[chunk.index] += chunk.token_ids
        singles = [
            client.generate(PROMPT, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=6))
            for i in range(2)
        ]
        assert [by_index[0], by_index[1]] == [s.token_ids for s in singles]
        assert chunks[-1].finished and sum(c.finish_reason is not None for c in chunks) == 2
    out = io.StringIO()
    args = _cli_args(server.grpc_target)
    assert run_generate(args, out) == 0
    text = out.getvalue()
    assert "[0] (length)" in text and "[1] (length)" in text and want.text in text
    assert wait_until_idle(loop_thread, backend).kv_blocks_leaked == 0


def _cli_args(target: str) -> Any:
    import argparse

    from bucketserve.gateway.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(
        ["generate", PROMPT, "--target", target, "--n", "2", "--temperature", "0",
         "--max-tokens", "6"]
    )
