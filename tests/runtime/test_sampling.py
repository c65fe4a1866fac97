"""Sampling through the engine: seeds, top-k, stop strings / ids, and parameter validation."""

from __future__ import annotations

import pytest

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import FinishReason
from bucketserve.runtime.engine.llm import LLM
from bucketserve.runtime.engine.llm_engine import LLMEngine
from tests.runtime import test_engine
from tests.runtime.test_engine import drain_all, token_prompts

tiny_runner = test_engine.tiny_runner  # shared module fixtures
small_pool_runner = test_engine.small_pool_runner

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)


def test_seeded_request_ignores_its_batch_and_preemption(tiny_runner, small_pool_runner):
    prompt = token_prompts(1, seed=7)[0]
    alone = LLM(runner=tiny_runner).generate([prompt], SEEDED, use_tqdm=False)[0].token_ids
    others = token_prompts(5, seed=8)
    crowd_params = [
        SamplingParams(temperature=1.0, max_tokens=16),  # unseeded
        SamplingParams(temperature=0, max_tokens=16),
        SamplingParams(temperature=0.5, top_k=20, seed=5, max_tokens=16),
        SamplingParams(temperature=1.2, max_tokens=16),
        SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16),
    ]
    engine = LLMEngine.from_kwargs(runner=small_pool_runner, max_num_seqs=4)
    crowd = drain_all(engine, [*others[:2], prompt, *others[2:]], [*crowd_params[:2], SEEDED,
                                                                   *crowd_params[2:]])
    assert engine.stats.num_preemptions > 0
    assert crowd[2] == alone
    greedy = SamplingParams(temperature=0, max_tokens=16)
    assert alone != LLM(runner=tiny_runner).generate([prompt], greedy, use_tqdm=False)[0].token_ids


def test_top_k_1_is_greedy(tiny_runner):
    llm = LLM(runner=tiny_runner)
    prompts = token_prompts(3, seed=9)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    top1 = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=10), False)
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def boundary_stop(llm: LLM, token_ids: list[int], index: int) -> str:
    """A 4-char stop string straddling the boundary after output token `index`."""
    at = len(llm.tokenizer.decode(token_ids[: index + 1]))
    return llm.tokenizer.decode(token_ids)[at - 2 : at + 2]


def test_stop_string_across_tokens_ends_output_without_it(tiny_runner):
    llm = LLM(runner=tiny_runner)
    prompt = "The weather today is"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    stop = boundary_stop(llm, base.token_ids, 10)  # e.g. 'ms o' of ' drums occur'
    cut = base.text.find(stop)
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop, "never appears"])
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.text == base.text[:cut] and stop not in out.text
    assert (out.finish_reason, out.stop_reason) == (FinishReason.STOP, stop)
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(base.token_ids)


def test_stop_token_id_ends_output_including_it(tiny_runner):
    llm = LLM(runner=tiny_runner)
    prompt = token_prompts(1, seed=10)[0]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20), False)[0]
    stop_id = base.token_ids[6]
    end = base.token_ids.index(stop_id) + 1
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id])
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == base.token_ids[:end]
    assert (out.finish_reason, out.stop_reason) == (FinishReason.STOP, stop_id)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be in"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": -2}, "top_k must be -1"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"stop": ["ok", ""]}, "non-empty strings"),
        ({"stop_token_ids": [-1]}, "non-negative"),
        ({"seed": -5}, "seed must be"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(top_k=1, temperature=1.0).greedy
