"""Greedy parity with transformers on the real SmolLM2 weights, as one continuous batch."""

from __future__ import annotations

import warnings

import pytest
import torch

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.engine.llm_engine import LLMEngine
from bucketserve.runtime.worker.model_runner import ModelRunner, ModelRunnerConfig
from tests.runtime.test_engine import drain_all

pytestmark = pytest.mark.smollm

# The latency demo of seeds/batching-and-paged-attention.md.
SHORT_PROMPTS = [
    "What is the capital of France?",
    "Is Python interpreted or compiled? Answer in one sentence.",
    "What is 2 + 2?",
    "Name one fruit.",
]
LONG_PROMPTS = [
    "Explain in detail how the attention mechanism works in a transformer.",
    "Write a short story about a robot who learns to paint.",
    "Describe the history of the Roman Empire in significant detail.",
    "What are the key differences between supervised and unsupervised learning?",
]
NEW_TOKENS = 64
TIE = 1e-4  # a reference step whose top-two logits are this close may flip under rounding
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


def runner(smollm_dir, **kwargs) -> ModelRunner:
    return ModelRunner(
        ModelRunnerConfig(model=str(smollm_dir), dtype="float32", device="cpu", **kwargs)
    )


@pytest.fixture(scope="module")
def smollm_runner(smollm_dir) -> ModelRunner:
    return runner(smollm_dir, num_kv_blocks=256)


@pytest.fixture(scope="module")
def prompts(smollm_runner) -> list[list[int]]:
    tok = smollm_runner.tokenizer
    chats = [[{"role": "user", "content": p}] for p in SHORT_PROMPTS + LONG_PROMPTS]
    return [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in chats]


@pytest.fixture(scope="module")
def reference(smollm_dir, prompts) -> list[tuple[list[int], torch.Tensor]]:
    """transformers generate, one prompt at a time: tokens and each step's logits."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    refs = []
    for ids in prompts:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(ids) :].tolist()
        refs.append((tokens, torch.stack([step[0] for step in out.logits])))
    return refs


def assert_matches(got: list[list[int]], refs: list[tuple[list[int], torch.Tensor]]) -> None:
    """Token-identical, except after a step where the reference itself was a near-tie."""
    for i, (ours, (theirs, logits)) in enumerate(zip(got, refs, strict=True)):
        diverged = next(
            (j for j, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            None if len(ours) == len(theirs) else min(len(ours), len(theirs)),
        )
        if diverged is None:
            continue
        top2 = logits[diverged].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < TIE, (
            f"prompt {i}: token {diverged} differs ({ours[diverged:diverged + 3]} vs "
            f"{theirs[diverged:diverged + 3]}) and the reference's top-two gap is {gap:.2e}"
        )
        warnings.warn(
            f"prompt {i}: accepted a divergence at token {diverged}, where the reference's "
            f"top-two logits differ by only {gap:.2e}",
            stacklevel=2,
        )


def test_continuous_batch_matches_transformers(smollm_runner, prompts, reference):
    engine = LLMEngine.from_kwargs(runner=smollm_runner, max_num_seqs=3)
    got = drain_all(engine, prompts, [GREEDY] * len(prompts))
    assert_matches(got, reference)
    assert engine.stats.num_preemptions == 0
    assert engine.block_manager.num_free_blocks == 256


def test_matches_transformers_under_preemption(smollm_dir, prompts, reference):
    small = runner(smollm_dir, num_kv_blocks=12)  # 192 tokens for 3 running sequences
    engine = LLMEngine.from_kwargs(runner=small, max_num_seqs=3)
    got = drain_all(engine, prompts, [GREEDY] * len(prompts))
    assert engine.stats.num_preemptions > 0
    assert_matches(got, reference)
    assert engine.block_manager.num_free_blocks == 12


def test_graphs_mode_matches_transformers(smollm_dir, prompts, reference):
    """The blog's eight prompts in graphs mode: every step padded to a compiled shape."""
    graphs = runner(smollm_dir, num_kv_blocks=256, execution="graphs")
    engine = LLMEngine.from_kwargs(runner=graphs, max_num_seqs=3)
    got = drain_all(engine, prompts, [GREEDY] * len(prompts))
    assert_matches(got, reference)
    stats = graphs.graph_stats
    assert stats.misses > 0 and stats.prompt_padded_tokens >= stats.prompt_tokens > 0
