"""Pipeline stages in process: layer split, greedy parity with 1 stage and transformers,
microbatches really in flight together, streaming with one request, aborts, counters."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.engine.llm_engine import LLMEngine
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.pipeline.pipeline_executor import PipelineExecutor
from bucketserve.runtime.worker.pipeline.pipeline_stats import PipelineStats, handoff_seconds
from bucketserve.runtime.worker.pipeline.stage_clock import StageSpan
from bucketserve.runtime.worker.pipeline.stage_spec import split_layers
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from tests.runtime.test_engine import drain, drain_all, token_prompts

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def five_layers(tiny_model_factory) -> Path:
    return tiny_model_factory(num_hidden_layers=5)


def engine(model: Path, pp: int, **kwargs) -> LLMEngine:
    return LLMEngine.from_kwargs(
        model=str(model), block_size=BLOCK, num_kv_blocks=64, pipeline_parallel_size=pp, **kwargs
    )


def hf_greedy(model: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            seq = hf.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=n, min_new_tokens=n,
            )
            out.append(seq[0, len(ids):].tolist())
    return out


def test_layers_split_contiguously_and_as_evenly_as_possible():
    assert [(s.start, s.stop) for s in split_layers(5, 2)] == [(0, 3), (3, 5)]
    assert [(s.start, s.stop) for s in split_layers(5, 3)] == [(0, 2), (2, 4), (4, 5)]
    assert [(s.start, s.stop) for s in split_layers(30, 4)] == [
        (0, 8), (8, 16), (16, 23), (23, 30)
    ]
    specs = split_layers(3, 3)
    assert specs[0].is_first and specs[-1].is_last and not specs[1].is_first
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        split_layers(2, 3)
    with pytest.raises(ValueError, match="positive integer"):
        split_layers(2, 0)


def test_two_and_three_stages_equal_one_stage_and_transformers(five_layers):
    prompts = token_prompts(6, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 6
    got = {}
    for pp in (1, 2, 3):
        eng = engine(five_layers, pp, max_num_seqs=4)
        got[pp] = drain_all(eng, prompts, params)
        assert eng.block_manager.num_free_blocks == 64
        if pp > 1:
            assert isinstance(eng.executor, PipelineExecutor) and eng.executor.depth == pp
            layers = [(s.spec.start, s.spec.stop) for s in eng.runner.stages]
            assert layers == [(s.start, s.stop) for s in split_layers(5, pp)]
        eng.close()
    assert got[2] == got[1] and got[3] == got[1]
    assert got[1] == hf_greedy(five_layers, prompts, 8)


def test_two_microbatches_are_in_flight_at_once_on_different_stages(five_layers):
    eng = engine(five_layers, 2)
    got = drain_all(eng, token_prompts(4, seed=5), [GREEDY] * 4)
    stats = eng.runner.stats(spans=True)
    eng.close()
    assert eng.executor.peak_in_flight == 2 and all(len(t) == 10 for t in got)
    # microbatches hold disjoint halves of the running requests
    assert stats.microbatches >= 2 * 10 and stats.num_stages == 2
    first = [s for s in stats.spans if s.stage == 0]
    second = [s for s in stats.spans if s.stage == 1]
    overlaps = [
        (a, b) for a, b in itertools.product(first, second)
        if a.microbatch != b.microbatch and a.start < b.end and b.start < a.end
    ]
    assert overlaps, "stage 0 never ran one microbatch while stage 1 ran another"
    assert 0.0 <= stats.bubble_fraction < 1.0 and stats.active_s > 0


def test_a_single_request_streams_token_by_token_through_two_stages(five_layers):
    eng = engine(five_layers, 2)
    rid = eng.add_request(token_prompts(1, seed=7)[0], GREEDY)
    streams = drain(eng)
    eng.close()
    outs = streams[rid]
    assert [len(o.delta_token_ids) for o in outs] == [1] * 10 and outs[-1].finished


def test_a_request_arriving_while_one_is_in_flight_joins_the_pipeline(five_layers):
    eng = engine(five_layers, 2)
    prompts = token_prompts(2, seed=11)
    first = eng.add_request(prompts[0], GREEDY)
    eng.step()  # submits the first request's prefill; the second stage slot is free
    second = eng.add_request(prompts[1], GREEDY)
    streams = drain(eng)
    eng.close()
    alone = engine(five_layers, 1)
    expected = drain_all(alone, prompts, [GREEDY] * 2)
    assert [streams[first][-1].token_ids, streams[second][-1].token_ids] == expected


def test_aborts_mid_pipeline_free_every_block(five_layers):
    eng = engine(five_layers, 3, max_num_seqs=6)
    ids = [eng.add_request(p, GREEDY) for p in token_prompts(6, seed=9)]
    for _ in range(4):
        eng.step()
    assert eng.executor.num_in_flight > 0
    for rid in ids[::2]:
        assert eng.abort(rid)
    streams = drain(eng)
    eng.close()
    assert {streams[r][-1].finish_reason.value for r in ids[::2]} == {"cancelled"}
    assert all(len(streams[r][-1].token_ids) == 10 for r in ids[1::2])
    assert eng.block_manager.num_free_blocks == 64


def test_pipeline_counters():
    spans = [
        StageSpan(0, 0, 0.0, 1.0), StageSpan(1, 0, 1.5, 2.5),  # 0.5 s hand-off
        StageSpan(0, 1, 1.0, 2.0), StageSpan(1, 1, 2.5, 3.5),  # stage 1 busy until 2.5: none
    ]
    assert handoff_seconds(spans, 2) == pytest.approx(0.5)
    stats = PipelineStats(num_stages=2, active_s=4.0, busy_s=[2.0, 2.0], spans=spans)
    assert stats.bubble_fraction == pytest.approx(0.5)
    assert PipelineStats().bubble_fraction == 0.0


def test_bad_pipeline_options_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"pipeline_parallel_size\n  Input should be greater"):
        LLMEngine.from_kwargs(model=str(tiny_model_dir), pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        LLMEngine.from_kwargs(model=str(tiny_model_dir), pipeline_parallel_size=3)
    runner = ModelRunner(ModelRunnerConfig(model=str(tiny_model_dir), num_kv_blocks=8))
    with pytest.raises(ValueError, match="pass either it or an existing runner"):
        LLMEngine.from_kwargs(runner=runner, pipeline_parallel_size=2)


def test_samples_of_one_prompt_and_prompt_logprobs_through_two_stages(five_layers):
    prompt = token_prompts(1, seed=11)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=3, prompt_logprobs=0)
    finals = {}
    for pp in (1, 2):
        eng = engine(five_layers, pp)
        eng.add_request(prompt, params)
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    finals[pp] = out
        assert eng.block_manager.num_free_blocks == 64
        eng.close()
    assert [o.token_ids for o in finals[2].outputs] == [o.token_ids for o in finals[1].outputs]
    assert finals[2].prompt_logprobs is not None
    for a, b in zip(finals[1].prompt_logprobs, finals[2].prompt_logprobs, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
