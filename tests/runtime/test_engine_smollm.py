"""Greedy parity with transformers on the real SmolLM2 weights, as one continuous batch."""

from __future__ import annotations

import pytest

from bucketserve.runtime.engine.llm_engine import LLMEngine
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from tests.runtime.smollm_chat import GREEDY, assert_matches
from tests.runtime.test_engine import drain_all

pytestmark = pytest.mark.smollm


def runner(smollm_dir, **kwargs) -> ModelRunner:
    return ModelRunner(
        ModelRunnerConfig(model=str(smollm_dir), dtype="float32", device="cpu", **kwargs)
    )


def test_continuous_batch_matches_transformers(smollm_dir, smollm_prompts, smollm_reference):
    engine = LLMEngine.from_kwargs(runner=runner(smollm_dir, num_kv_blocks=256), max_num_seqs=3)
    got = drain_all(engine, smollm_prompts, [GREEDY] * len(smollm_prompts))
    assert_matches(got, smollm_reference)
    assert engine.stats.num_preemptions == 0
    assert engine.block_manager.num_free_blocks == 256


def test_matches_transformers_under_preemption(smollm_dir, smollm_prompts, smollm_reference):
    small = runner(smollm_dir, num_kv_blocks=8)  # 128 tokens for 3 running sequences
    engine = LLMEngine.from_kwargs(runner=small, max_num_seqs=3)
    got = drain_all(engine, smollm_prompts, [GREEDY] * len(smollm_prompts))
    assert engine.stats.num_preemptions > 0
    assert_matches(got, smollm_reference)
    assert engine.block_manager.num_free_blocks == 8


def test_graphs_mode_matches_transformers(smollm_dir, smollm_prompts, smollm_reference):
    """The blog's eight prompts in graphs mode: every step padded to a compiled shape."""
    graphs = runner(smollm_dir, num_kv_blocks=256, execution="graphs")
    engine = LLMEngine.from_kwargs(runner=graphs, max_num_seqs=3)
    got = drain_all(engine, smollm_prompts, [GREEDY] * len(smollm_prompts))
    assert_matches(got, smollm_reference)
    stats = graphs.graph_stats
    assert stats.misses > 0 and stats.prompt_padded_tokens >= stats.prompt_tokens > 0
