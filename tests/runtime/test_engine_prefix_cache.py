"""The engine with the prefix cache: prompts sharing 0, 1 or many blocks (and partial last
blocks) give the tokens they give with the cache off, a shared prefix is computed once, and
preemption under a small pool keeps output and accounting exact."""

from __future__ import annotations

import random

import pytest

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.engine.llm_engine import LLMEngine
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module", params=["eager", "graphs"])
def runner(tiny_model_dir, request) -> ModelRunner:
    return ModelRunner(
        ModelRunnerConfig(
            model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=96, execution=request.param
        )
    )


def shared_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, 49152) for _ in range(n)]  # noqa: E731
    system = words(4 * BLOCK + 2)  # many full blocks and a partial one
    one = words(BLOCK)
    return [
        system + words(5),
        system + words(3),
        system[: 4 * BLOCK] + words(1),  # ends right after the shared blocks
        one + words(6),
        one + words(2),
        words(7),  # shares nothing
        system + system[-2:],  # the shared blocks, then its own partial block
    ]


def run(engine: LLMEngine, prompts, one_at_a_time: bool) -> tuple[list[list[int]], list[int]]:
    outs, cached = [], []
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    for batch in batches:
        ids = [engine.add_request(p, GREEDY) for p in batch]
        final = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        outs += [final[i].token_ids for i in ids]
        cached += [final[i].num_cached_tokens for i in ids]
    return outs, cached


@pytest.mark.parametrize("one_at_a_time", [True, False])
def test_cached_prefixes_change_no_token(runner, one_at_a_time):
    prompts = shared_prompts()
    off, off_cached = run(
        LLMEngine.from_kwargs(runner=runner, enable_prefix_caching=False), prompts, True
    )
    engine = LLMEngine.from_kwargs(runner=runner)
    on, cached = run(engine, prompts, one_at_a_time)
    assert on == off
    assert off_cached == [0] * len(prompts)
    if one_at_a_time:  # each finds what the ones before it left
        assert cached == [0, 4 * BLOCK, 4 * BLOCK, 0, BLOCK, 0, 4 * BLOCK]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_the_second_request_computes_only_its_suffix(runner):
    rng = random.Random(1)
    prefix = [rng.randrange(3, 49152) for _ in range(128)]
    engine = LLMEngine.from_kwargs(runner=runner, max_num_batched_tokens=4096)
    run(engine, [[*prefix, 11, 12, 13]], True)
    computed = []
    original = engine.scheduler.update

    def spy(out, tokens):
        computed.append(sum(out.num_new_tokens))
        return original(out, tokens)

    engine.scheduler.update = spy
    _, cached = run(engine, [[*prefix, 21, 22]], True)
    assert cached == [128]
    assert computed[0] == 2  # the suffix, not 130 tokens


def test_preemption_with_the_cache_keeps_tokens_and_accounting(tiny_model_dir):
    small = ModelRunner(
        ModelRunnerConfig(model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=14)
    )
    prompts = shared_prompts(seed=2)[:5]
    params = SamplingParams(temperature=0, max_tokens=16)
    ref = []
    for p in prompts:
        e = LLMEngine.from_kwargs(runner=small, max_num_seqs=1, enable_prefix_caching=False)
        rid = e.add_request(p, params)
        while e.has_unfinished():
            outs = [o for o in e.step() if o.finished and o.request_id == rid]
            if outs:
                ref.append(outs[0].token_ids)
    engine = LLMEngine.from_kwargs(runner=small, max_num_seqs=4)
    ids = [engine.add_request(p, params) for p in prompts]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
    assert engine.stats.num_preemptions > 0
    assert [final[i] for i in ids] == ref
    assert engine.block_manager.num_free_blocks == 14
