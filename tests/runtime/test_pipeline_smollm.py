"""SmolLM2 in 2 pipeline stages: greedy parity with transformers (30 layers: 15 + 15)."""

from __future__ import annotations

import pytest

from bucketserve.runtime.engine.llm_engine import LLMEngine
from tests.runtime.smollm_chat import GREEDY, assert_matches
from tests.runtime.test_engine import drain_all

pytestmark = pytest.mark.smollm


def test_two_stages_match_transformers(smollm_dir, smollm_prompts, smollm_reference):
    engine = LLMEngine.from_kwargs(
        model=str(smollm_dir), dtype="float32", device="cpu", num_kv_blocks=256,
        max_num_seqs=4, pipeline_parallel_size=2, stage_torch_threads=1,
    )
    try:
        got = drain_all(engine, smollm_prompts, [GREEDY] * len(smollm_prompts))
        assert engine.executor.peak_in_flight == 2
        assert [(s.spec.start, s.spec.stop) for s in engine.runner.stages] == [(0, 15), (15, 30)]
    finally:
        engine.close()
    assert_matches(got, smollm_reference)
    assert engine.block_manager.num_free_blocks == 256
