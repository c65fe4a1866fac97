"""n > 1 samples of one prompt in the engine: the prompt is computed once, the samples share
its full KV blocks through the block manager's reference counts, each samples its own
tokens (sample i seeded with seed + i), and every block is free after drain or abort."""

from __future__ import annotations

import pytest

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import FinishReason
from bucketserve.runtime.engine.llm import LLM
from bucketserve.runtime.engine.llm_engine import LLMEngine
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

BLOCK = 4
PROMPT = [17, 230, 4051, 99, 1200, 7, 8, 612, 33, 901]  # 10 tokens: 2 full blocks + 2


@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> ModelRunner:
    return ModelRunner(
        ModelRunnerConfig(model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=64)
    )


def run(engine: LLMEngine, check=None) -> dict:
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if check:
            check(engine)
    return finals


def one(runner, params: SamplingParams, **kwargs) -> list[int]:
    engine = LLMEngine.from_kwargs(runner=runner, **kwargs)
    rid = engine.add_request(PROMPT, params)
    return run(engine)[rid].token_ids


def test_greedy_samples_equal_the_single_output(runner):
    single = one(runner, SamplingParams(temperature=0, max_tokens=9))
    engine = LLMEngine.from_kwargs(runner=runner)
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=9, n=3))
    final = run(engine)[rid]
    assert [o.index for o in final.outputs] == [0, 1, 2]
    assert [o.token_ids for o in final.outputs] == [single] * 3
    assert all(o.finish_reason == FinishReason.LENGTH for o in final.outputs)
    assert final.token_ids == single and final.finished
    assert engine.block_manager.num_free_blocks == 64


def test_seeded_samples_equal_single_runs_with_seed_plus_i(runner):
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=1234)
    singles = [one(runner, SamplingParams(temperature=1.0, max_tokens=8, seed=1234 + i))
               for i in range(3)]
    assert len({tuple(s) for s in singles}) > 1  # the seeds do make different samples
    engine = LLMEngine.from_kwargs(runner=runner)
    rid = engine.add_request(PROMPT, SamplingParams(**{**params.__dict__, "n": 3}))
    assert [o.token_ids for o in run(engine)[rid].outputs] == singles


def test_prompt_blocks_are_shared_by_reference_count(runner):
    engine = LLMEngine.from_kwargs(runner=runner)
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=6, n=3))
    engine.step()  # the prompt, computed once by sample 0; samples 1 and 2 fork from it
    parent = engine.scheduler.get(rid)
    children = [engine.scheduler.get(f"{rid}#{i}") for i in (1, 2)]
    shared = parent.block_table[:2]  # the full blocks before the one with the last token
    assert [engine.block_manager.ref_count(b) for b in shared] == [3, 3]
    assert all(c.block_table == shared and c.num_computed_tokens == 8 for c in children)
    engine.step()  # samples 1 and 2 compute the 2 tail tokens into blocks of their own
    tails = [c.block_table[2] for c in children]
    assert len({parent.block_table[2], *tails}) == 3
    used_shared = 64 - engine.block_manager.num_free_blocks

    separate = LLMEngine.from_kwargs(runner=runner, enable_prefix_caching=False)
    for _ in range(3):
        separate.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=6))
    separate.step()
    separate.step()
    used_separate = 64 - separate.block_manager.num_free_blocks
    assert used_shared == 2 + 3 == used_separate - 4  # the 2 full prompt blocks held once
    run(engine)
    run(separate)
    assert engine.block_manager.num_free_blocks == 64


def test_abort_mid_generation_frees_every_block(runner):
    engine = LLMEngine.from_kwargs(runner=runner)
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0.8, max_tokens=30, n=4))
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < 64
    assert engine.abort(rid)
    final = run(engine)[rid]
    assert final.finished and len(final.outputs) == 4
    assert all(o.finish_reason == FinishReason.CANCELLED for o in final.outputs)
    assert engine.block_manager.num_free_blocks == 64


def test_abort_before_the_prompt_is_computed(runner):
    engine = LLMEngine.from_kwargs(runner=runner)
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=5, n=3))
    assert engine.abort(rid)
    final = run(engine)[rid]
    assert [o.finish_reason for o in final.outputs] == [FinishReason.CANCELLED] * 3
    assert engine.block_manager.num_free_blocks == 64 and not engine.scheduler.has_unfinished()


def test_a_finished_sample_frees_only_its_own_blocks(runner):
    engine = LLMEngine.from_kwargs(runner=runner)
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=12, n=3))
    engine.step()
    engine.step()
    parent = engine.scheduler.get(rid)
    shared = parent.block_table[:2]
    child = engine.scheduler.get(f"{rid}#2")
    own = child.block_table[2:]
    engine.scheduler.abort(child.seq_id)  # as a stop string ending sample 2 would
    assert [engine.block_manager.ref_count(b) for b in shared] == [2, 2]
    assert all(engine.block_manager.ref_count(b) == 0 for b in own)
    final = run(engine)[rid]
    assert [len(o.token_ids) for o in final.outputs][:2] == [12, 12]
    assert final.outputs[2].finish_reason == FinishReason.CANCELLED
    assert engine.block_manager.num_free_blocks == 64


def test_chunked_prefill_and_preemption_keep_the_samples(tiny_model_dir):
    small = ModelRunner(
        ModelRunnerConfig(model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=12)
    )
    single = one(small, SamplingParams(temperature=0, max_tokens=14))
    engine = LLMEngine.from_kwargs(runner=small, max_num_batched_tokens=4)
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=14, n=3))
    final = run(engine)[rid]
    assert engine.stats.num_preemptions > 0  # 3 x 24 tokens do not fit 12 blocks of 4
    assert [o.token_ids for o in final.outputs] == [single] * 3
    assert engine.block_manager.num_free_blocks == 12


def test_llm_generate_returns_n_completions(runner):
    llm = LLM(runner=runner)
    outs = llm.generate([PROMPT, PROMPT[:5]], SamplingParams(temperature=0, max_tokens=4, n=2),
                        use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 2]
    for out in outs:
        assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.token_ids
        assert out.outputs[0].text == out.outputs[1].text and out.outputs[0].text
    assert llm.engine.block_manager.num_free_blocks == 64


def test_ids_of_samples_are_reserved(runner):
    engine = LLMEngine.from_kwargs(runner=runner)
    engine.add_request(PROMPT, SamplingParams(max_tokens=2, n=2), request_id="a")
    with pytest.raises(ValueError, match="'a#1' is already in use"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=2), request_id="a#1")
    with pytest.raises(ValueError, match="one sample"):
        engine.add_request(PROMPT, SamplingParams(n=2), output_token_ids=[5])
    run(engine)
    assert engine.block_manager.num_free_blocks == 64
