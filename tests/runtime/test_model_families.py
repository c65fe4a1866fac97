"""Every family in the model registry against transformers: a tiny random-weight model of
each, built with transformers' own config class and saved as a Hugging Face directory,
loaded through the public engine; greedy tokens equal transformers' over prompts longer
than the sliding window (where the family has one), through paged KV small enough to
preempt, in eager and graphs mode."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.engine.llm_engine import LLMEngine
from bucketserve.runtime.io.model_config import RopeScaling
from bucketserve.runtime.models import load_model_config, model_class, parse_model_config
from bucketserve.runtime.models.registry import FAMILIES as SERVED
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

pytestmark = pytest.mark.slow  # compiles graphs of every family

BLOCK = 4
WINDOW = 8  # tokens: two blocks
VOCAB = 1024
NUM_BLOCKS = 16  # a sequence takes up to 12 blocks: four do not fit, preemption
MAX_TOKENS = 10
# the unified bucket every graphs-mode step here pads to: (tokens, shared blocks, unique
# blocks, causal), holding any step (a step reads at most the pool's blocks); one compiled
# graph per region (per window for the decoder layer) for the whole run
UNIFIED = (16, NUM_BLOCKS, NUM_BLOCKS, 1)

SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,  # wide logits: no near-ties for greedy comparisons
    "bos_token_id": 1,
    "eos_token_id": 2,
}
LLAMA_LIKE = {"intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 16}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", {**LLAMA_LIKE, "tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {**LLAMA_LIKE, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {**LLAMA_LIKE, "sliding_window": WINDOW}),
    "phi3": ("Phi3Config", {**LLAMA_LIKE, "sliding_window": WINDOW, "pad_token_id": 0}),
    "gemma3": (
        "Gemma3TextConfig",
        {
            **LLAMA_LIKE,
            "num_key_value_heads": 1,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 30.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),
    "opt": ("OPTConfig", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    # OPT-350m's layout: post-norm layers, embeddings narrower than the hidden size
    "opt-post-norm": (
        "OPTConfig",
        {"ffn_dim": 128, "word_embed_proj_dim": 32, "do_layer_norm_before": False},
    ),
}


class Family(NamedTuple):
    model_dir: Path
    greedy: list[list[int]]
    last_logits: torch.Tensor


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, smollm_tokenizer_dir) -> Family:
    """A family's tiny model directory, transformers' greedy tokens for `prompts()` and its
    logits of each prompt's last token."""
    config_cls, overrides = FAMILIES[request.param]
    config = getattr(transformers, config_cls)(**{**SHAPE, **overrides})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases and norms start at 0 / 1: make them count
        for name, param in hf.named_parameters():
            if "bias" in name or "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    out = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out)
    for f in smollm_tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    with torch.no_grad():
        logits = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts()])
    return Family(out, hf_greedy(hf, prompts()), logits)


def prompts(seed: int = 0) -> list[list[int]]:
    """Four prompts, each several windows long."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (23, 37, 30, 17)]


def hf_greedy(hf: torch.nn.Module, token_lists: list[list[int]]) -> list[list[int]]:
    out = []
    for ids in token_lists:
        ids = list(ids)
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[-MAX_TOKENS:])
    return out


def run_engine(model_dir: Path, execution: str) -> tuple[list[list[int]], LLMEngine]:
    """`prompts()` through an engine whose pool preempts; "pipeline": eager steps over
    three stages of one layer each (embedding on the first, norm and head on the last)."""
    stages = 3 if execution == "pipeline" else 1
    engine = LLMEngine.from_kwargs(
        model=str(model_dir),
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        execution="eager" if execution == "pipeline" else execution,
        pipeline_parallel_size=stages,
        max_num_seqs=4,
        max_num_batched_tokens=UNIFIED[0],  # prompts are chunked beside decode rows
    )
    if execution == "graphs":
        engine.runner.warmup([UNIFIED])
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, greedy) for p in prompts()]
    final = {}
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
    finally:
        engine.close()
    return [final[i].token_ids for i in ids], engine


@pytest.mark.parametrize("execution", ["eager", "graphs", "pipeline"])
def test_greedy_tokens_equal_transformers(family, execution):
    model_dir, reference, _ = family
    config = load_model_config(model_dir)
    if config.sliding_window is not None:
        assert min(map(len, prompts())) > 2 * config.sliding_window
    got, engine = run_engine(model_dir, execution)
    assert got == reference
    assert engine.stats.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS
    if execution == "graphs":
        assert engine.runner.graph_stats.misses == 0  # every step ran the warmed graph


def test_prompt_logits_equal_transformers(family):
    """Each prompt in one step, one after another in a shuffled pool: the last token's
    logits (a monotone softcap would hide from greedy tokens) within float32 noise."""
    runner = ModelRunner(
        ModelRunnerConfig(model=str(family.model_dir), block_size=BLOCK, num_kv_blocks=64)
    )
    pool = list(range(64))
    random.Random(1).shuffle(pool)
    seqs = []
    for p in prompts():
        seq = Sequence(p, SamplingParams(temperature=0))
        seq.block_table = [pool.pop() for _ in range(-(-len(p) // BLOCK))]
        seqs.append(seq)
    logits = runner.compute_logits(seqs, [len(p) for p in prompts()])
    torch.testing.assert_close(logits, family.last_logits, atol=1e-4, rtol=1e-4)


def test_the_registry_is_the_one_list_of_families():
    architectures = [a for f in SERVED for a in f.architectures]
    assert len(architectures) == len(set(architectures))
    assert all(model_class(a) is f.model for f in SERVED for a in f.architectures)
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*Gemma3"):
        model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPTNeoXForCausalLM'.*OPT"):
        parse_model_config({"architectures": ["GPTNeoXForCausalLM"]})


GEMMA3_270M_CONFIG = {  # as the Hugging Face checkpoint (transformers 4) and our GGUF converter
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": None,
    "sliding_window": 512,
    "_sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "eos_token_id": 1,
}


def test_gemma3_config_in_the_transformers_4_layout():
    c = parse_model_config(GEMMA3_270M_CONFIG)
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (1e6, 1e4, None)
    assert c.tie_word_embeddings and c.hidden_act == "gelu_pytorch_tanh"
    windows = [c.layer_sliding_window(i) for i in range(18)]
    assert windows == [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    scaled = parse_model_config(
        {**GEMMA3_270M_CONFIG, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    )
    assert scaled.rope_scaling == RopeScaling("linear", 8.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        parse_model_config({**GEMMA3_270M_CONFIG, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported for Gemma3"):
        parse_model_config({**GEMMA3_270M_CONFIG, "hidden_activation": "relu"})


def test_qwen2_window_only_where_the_config_turns_it_on():
    base = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8}
    base |= {"intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2}
    off = parse_model_config({**base, "sliding_window": 32, "use_sliding_window": False})
    assert off.sliding_window is None and off.layer_sliding_window(3) is None
    on = {**base, "sliding_window": 32, "use_sliding_window": True, "max_window_layers": 2}
    windows = [parse_model_config(on).layer_sliding_window(i) for i in range(4)]
    assert windows == [None, None, 32, 32]


PROMPT_BUCKET = (4, 40, 12)  # (batch, query, table width in blocks): the four prompts at once
DECODE_BUCKET = (4, 1, 48)  # decode: the batch's blocks in all


@pytest.mark.parametrize("family", ["mistral", "gemma3", "opt-post-norm"], indirect=True)
def test_shape_bucket_graphs_equal_transformers(family):
    """Graphs mode with prompt and decode shape buckets (the exponential strategy's kind,
    not unified steps): the padded prompt rectangle and the flat decode list, each layer
    with its own window, give transformers' tokens with nothing compiled after warm-up.
    The families whose graph regions differ: windows, Gemma's head and tail, OPT's."""
    runner = ModelRunner(
        ModelRunnerConfig(
            model=str(family.model_dir), block_size=BLOCK, num_kv_blocks=64, execution="graphs"
        )
    )
    runner.warmup([PROMPT_BUCKET, DECODE_BUCKET])
    free = list(range(64))
    random.Random(2).shuffle(free)
    seqs = [Sequence(p, SamplingParams(temperature=0)) for p in prompts()]
    for s in seqs:
        s.block_table = [free.pop() for _ in range(-(-(len(s) + MAX_TOKENS) // BLOCK))]
    counts, bucket = [len(s) for s in seqs], PROMPT_BUCKET
    while seqs[0].num_output_tokens < MAX_TOKENS:
        tokens = runner.execute(seqs, counts, bucket)
        for s, n, token in zip(seqs, counts, tokens, strict=True):
            s.num_computed_tokens += n
            s.append_token(token)
        counts, bucket = [1] * len(seqs), DECODE_BUCKET
    assert [s.output_token_ids for s in seqs] == family.greedy
    assert runner.graph_stats.misses == 0
