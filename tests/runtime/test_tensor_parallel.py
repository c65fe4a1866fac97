"""Tensor parallelism within a worker: two ranks (this process and a spawned one, gloo)
give the greedy tokens of one rank and of transformers, whether the KV heads split over
the ranks or must be replicated onto them (with a vocabulary that does not split evenly),
in eager and graphs mode, and for the families that shard differently; a model that cannot
split is refused; a dead rank fails the step at once instead of hanging its collectives.
Two pipeline stages of two ranks each give the same tokens, and a dead rank of a stage
fails its stage (StageDeadError: the worker's group goes down)."""

from __future__ import annotations

import os
import random
import shutil
import signal
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.engine.llm_engine import LLMEngine
from bucketserve.runtime.models import load_model_config, parse_model_config
from bucketserve.runtime.models.causal_lm import check_tensor_parallel
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from bucketserve.runtime.worker.tensor_parallel.tp_runner import (
    RankDeadError,
    TensorParallelRunner,
)
from tests.runtime.test_model_families import family, hf_greedy  # noqa: F401 (a fixture)
from tests.runtime.test_model_families import prompts as family_prompts

BLOCK = 4
NUM_BLOCKS = 16  # the four prompts need up to 12 blocks each: preemption
MAX_TOKENS = 10
VOCAB = 1001  # odd: the last rank's share of the vocabulary is padded
UNIFIED = (16, NUM_BLOCKS, NUM_BLOCKS, 1)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (23, 37, 30, 17)]


@pytest.fixture(scope="module", params=[4, 1], ids=["kv_split", "kv_replicated"])
def llama(request, tmp_path_factory, smollm_tokenizer_dir) -> tuple[Path, list[list[int]]]:
    """A tiny Llama with biases (4 heads; 4 KV heads: two per rank, or 1: on both ranks,
    its embedding tied) and transformers' greedy tokens of `prompts()`."""
    kv = request.param
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv, head_dim=16, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=kv == 1, attention_bias=True, mlp_bias=True,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    out = tmp_path_factory.mktemp(f"tp_llama_kv{kv}")
    hf.save_pretrained(out)
    for f in smollm_tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out, hf_greedy(hf, prompts())


def run(
    model_dir: Path, tp: int, execution: str = "eager", token_lists: list[list[int]] | None = None
) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine.from_kwargs(
        model=str(model_dir),
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        execution=execution,
        tensor_parallel_size=tp,
        max_num_seqs=4,
        max_num_batched_tokens=UNIFIED[0],
    )
    try:
        if execution == "graphs":
            engine.runner.warmup([UNIFIED])
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        ids = [engine.add_request(p, greedy) for p in token_lists or prompts()]
        final = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
    finally:
        engine.close()
    return [final[i].token_ids for i in ids], engine


def test_two_ranks_equal_one_and_transformers(llama):
    model_dir, reference = llama
    one, _ = run(model_dir, 1)
    two, engine = run(model_dir, 2)
    assert one == reference
    assert two == reference
    heads = load_model_config(model_dir).num_key_value_heads
    assert engine.runner.kv_cache.num_kv_heads == max(1, heads // 2)  # the head rank's pool
    assert engine.stats.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS
    assert not engine.runner.alive()  # close() stopped the other rank


@pytest.mark.slow  # two inductor compiles of every region (~40 s each on 2 cores)
@pytest.mark.parametrize("llama", [4], ids=["kv_split"], indirect=True)  # regions alike
def test_two_ranks_in_graphs_mode(llama):
    """The all-reduces and the logits' all-gather run inside the compiled regions (custom
    ops inductor leaves opaque)."""
    model_dir, reference = llama
    got, engine = run(model_dir, 2, "graphs")
    assert got == reference
    assert engine.runner.graph_stats.misses == 0
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


@pytest.mark.slow  # a rank process per family (~6 s each)
# the families whose layers shard differently from Llama's: q/k/v biases alone; one KV head
# replicated, q/k norms and a tied head; biases everywhere, learned positions, projections
@pytest.mark.parametrize("family", ["qwen2", "gemma3", "opt-post-norm"], indirect=True)
def test_families_that_shard_differently_over_two_ranks(family):  # noqa: F811 (the imported fixture)
    got, engine = run(family.model_dir, 2, token_lists=family_prompts())
    assert got == family.greedy
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_a_model_that_does_not_split_is_refused():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 48}
    base |= {"intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 6}
    check_tensor_parallel(parse_model_config({**base, "num_key_value_heads": 2}), 2)
    check_tensor_parallel(parse_model_config({**base, "num_key_value_heads": 1}), 2)
    with pytest.raises(ValueError, match="num_attention_heads 6"):
        check_tensor_parallel(parse_model_config({**base, "num_key_value_heads": 2}), 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads 3 \(neither divides"):
        check_tensor_parallel(parse_model_config({**base, "num_key_value_heads": 3}), 2)


def test_a_dead_rank_fails_the_next_step_at_once(llama):
    runner = TensorParallelRunner(
        ModelRunnerConfig(model=str(llama[0]), block_size=BLOCK, num_kv_blocks=NUM_BLOCKS), 2
    )
    try:
        seq = Sequence(prompts()[0], SamplingParams(temperature=0))
        seq.block_table = list(range(-(-len(seq) // BLOCK)))
        assert runner.execute([seq], [len(seq)]) == [llama[1][0][0]]
        os.kill(runner.rank_pids[0], signal.SIGKILL)
        runner.ranks[0].process.join(timeout=60)
        assert not runner.alive()
        with pytest.raises((RankDeadError, RuntimeError)):
            runner.execute([seq], [len(seq)])
    finally:
        runner.shutdown()


@pytest.mark.parametrize("llama", [1], ids=["kv_replicated"], indirect=True)
def test_two_stages_of_two_ranks_equal_transformers_and_a_dead_rank_fails_its_stage(llama):
    """TP 2 x PP 2: each stage's layer sharded over its head (a thread here) and a spawned
    rank; the last stage holds the tied, vocab-parallel head. Then stage 1's rank dies."""
    from bucketserve.runtime.worker.pipeline.stage import StageDeadError

    model_dir, reference = llama
    engine = LLMEngine.from_kwargs(
        model=str(model_dir), block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
        tensor_parallel_size=2, pipeline_parallel_size=2, max_num_seqs=4,
        max_num_batched_tokens=UNIFIED[0],
    )  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        infos = engine.runner.stage_infos
        assert [i["layers"] for i in infos] == [[0, 1], [1, 2]]
        assert [i["tensor_parallel_size"] for i in infos] == [2, 2]
        assert all(s.runner.kv_cache.num_kv_heads == 1 for s in engine.runner.stages)
        ids = [engine.add_request(p, greedy) for p in prompts()]
        final = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        assert [final[i].token_ids for i in ids] == reference
        assert engine.stats.num_preemptions > 0
        assert engine.block_manager.num_free_blocks == NUM_BLOCKS

        stage1 = engine.runner.stages[1].runner
        os.kill(stage1.rank_pids[0], signal.SIGKILL)
        stage1.ranks[0].process.join(timeout=60)
        engine.add_request(prompts()[0], greedy)
        with pytest.raises(StageDeadError, match="stage 1's tensor-parallel group"):
            while engine.has_unfinished():
                engine.step()
    finally:
        engine.close()
    assert not any(s.runner.alive() for s in engine.runner.stages)  # close() stopped the ranks
