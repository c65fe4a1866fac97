"""Prompt logprobs (vLLM's `prompt_logprobs`): log_softmax of the logits at every prompt
position, equal to transformers' on the same weights, whole or chunked, with the first
prompt token's entry None, and computed only for the requests that ask."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.engine.llm_engine import LLMEngine
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

PROMPT = [17, 230, 4051, 99, 1200, 7, 8, 612, 33, 901, 45, 3, 2999]


@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> ModelRunner:
    return ModelRunner(ModelRunnerConfig(model=str(tiny_model_dir), block_size=4,
                                         num_kv_blocks=64))


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)  # row p: the distribution of token p+1


def finals(engine: LLMEngine) -> dict:
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o
    return out


@pytest.mark.parametrize("budget", [2048, 5])  # whole, and chunked into 5-token steps
def test_prompt_logprobs_equal_transformers(runner, hf_logprobs, budget):
    engine = LLMEngine.from_kwargs(runner=runner, max_num_batched_tokens=budget)
    asks = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=3,
                                                     prompt_logprobs=4))
    plain = engine.add_request(PROMPT[:6], SamplingParams(temperature=0, max_tokens=3))
    out = finals(engine)
    got = out[asks].prompt_logprobs
    assert out[plain].prompt_logprobs is None
    assert len(got) == len(PROMPT) and got[0] is None
    for pos in range(1, len(PROMPT)):
        want = hf_logprobs[pos - 1]
        assert got[pos].logprob == pytest.approx(want[PROMPT[pos]].item(), abs=1e-3)
        top_v, top_i = want.topk(4)
        assert [t for t, _ in got[pos].top] == top_i.tolist()
        assert [v for _, v in got[pos].top] == pytest.approx(top_v.tolist(), abs=1e-3)
    assert engine.block_manager.num_free_blocks == 64


def test_prompt_logprobs_with_n_samples_come_once(runner, hf_logprobs):
    engine = LLMEngine.from_kwargs(runner=runner)
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=2, n=3,
                                                    prompt_logprobs=0))
    out = finals(engine)[rid]
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == len(PROMPT)
    assert out.prompt_logprobs[-1].logprob == pytest.approx(
        hf_logprobs[-2][PROMPT[-1]].item(), abs=1e-3)
    assert out.prompt_logprobs[-1].top == []


def test_out_of_range_prompt_logprobs_are_refused():
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None or an integer in \[0, 20"):
        SamplingParams(prompt_logprobs=21)
