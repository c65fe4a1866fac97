"""The paged Llama forward against transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.io.model_config import RopeScaling
from bucketserve.runtime.layers.rotary_embedding import rope_inv_freq
from bucketserve.runtime.models import load_model_config, parse_model_config
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

BLOCK = 4
VOCAB = 49152


def make_runner(model_dir, num_kv_blocks: int = 64) -> ModelRunner:
    return ModelRunner(
        ModelRunnerConfig(model=str(model_dir), block_size=BLOCK, num_kv_blocks=num_kv_blocks)
    )


def make_seqs(lengths: list[int], blocks: list[int], seed: int = 0) -> list[Sequence]:
    """Random prompts whose block tables come from the shuffled `blocks` pool."""
    rng = random.Random(seed)
    pool = list(blocks)
    rng.shuffle(pool)
    seqs = []
    for n in lengths:
        seq = Sequence([rng.randrange(VOCAB) for _ in range(n)], SamplingParams(temperature=0))
        seq.block_table = [pool.pop() for _ in range(-(-(n + 8) // BLOCK))]
        seqs.append(seq)
    return seqs


def reference_logits(hf, seqs: list[Sequence], upto: list[int]) -> torch.Tensor:
    with torch.no_grad():
        rows = [
            hf(torch.tensor([s.token_ids[:n]])).logits[0, -1]
            for s, n in zip(seqs, upto, strict=True)
        ]
    return torch.stack(rows)


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def run_and_advance(runner, seqs, chunks, pad_to=None) -> torch.Tensor:
    logits = runner.compute_logits(seqs, chunks, pad_to)
    for seq, n in zip(seqs, chunks, strict=True):
        seq.num_computed_tokens += n
    return logits


def test_mixed_prefill_decode_batch_matches_transformers(tiny_model_dir, hf_tiny):
    runner = make_runner(tiny_model_dir)
    seqs = make_seqs([5, 9, 3, 13], range(64))
    # Step 1: whole prompts, a partial chunk and a chunk of a longer prompt.
    logits = run_and_advance(runner, seqs, [5, 9, 2, 6])
    torch.testing.assert_close(
        logits, reference_logits(hf_tiny, seqs, [5, 9, 2, 6]), atol=1e-4, rtol=0
    )
    # Step 2: two decode rows, the rest of one prompt, the rest of another.
    for seq in seqs[:2]:
        seq.append_token(7)
    logits = run_and_advance(runner, seqs, [1, 1, 1, 7])
    upto = [len(s) for s in seqs]
    torch.testing.assert_close(logits, reference_logits(hf_tiny, seqs, upto), atol=1e-4, rtol=0)
    # Step 3: every row decodes.
    for i, seq in enumerate(seqs):
        seq.append_token(100 + i)
    logits = run_and_advance(runner, seqs, [1, 1, 1, 1])
    upto = [len(s) for s in seqs]
    torch.testing.assert_close(logits, reference_logits(hf_tiny, seqs, upto), atol=1e-4, rtol=0)


def test_padded_step_matches_transformers(tiny_model_dir, hf_tiny):
    runner = make_runner(tiny_model_dir)
    seqs = make_seqs([6, 3], range(64), seed=1)
    logits = run_and_advance(runner, seqs, [6, 3], pad_to=(4, 8, 8))
    torch.testing.assert_close(logits, reference_logits(hf_tiny, seqs, [6, 3]), atol=1e-4, rtol=0)
    for seq in seqs:
        seq.append_token(11)
    logits = run_and_advance(runner, seqs, [1, 1], pad_to=(4, 1, 8))
    upto = [len(s) for s in seqs]
    torch.testing.assert_close(logits, reference_logits(hf_tiny, seqs, upto), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_scaling": None},
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {"tie_word_embeddings": False, "num_key_value_heads": 4, "attention_bias": True},
        {"num_key_value_heads": 1, "rope_theta": 500000.0},
    ],
    ids=["no-scaling", "linear", "untied-mha-bias", "mqa-theta"],
)
def test_config_variants_match_transformers(tiny_model_factory, overrides):
    model_dir = tiny_model_factory(**overrides)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = make_runner(model_dir)
    # Long enough that scaled and unscaled frequencies differ visibly.
    seqs = make_seqs([40, 17], range(64), seed=2)
    logits = run_and_advance(runner, seqs, [40, 17])
    torch.testing.assert_close(logits, reference_logits(hf, seqs, [40, 17]), atol=1e-4, rtol=0)


def test_rope_scaling_changes_frequencies():
    base = rope_inv_freq(16, 10000.0, None)
    linear = rope_inv_freq(16, 10000.0, RopeScaling("linear", 4.0))
    torch.testing.assert_close(linear, base / 4)
    llama3 = rope_inv_freq(16, 10000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    wavelen = 2 * torch.pi / base
    assert torch.equal(llama3[wavelen < 16], base[wavelen < 16])  # high frequencies kept
    torch.testing.assert_close(llama3[wavelen > 64], base[wavelen > 64] / 8)  # low ones scaled
    mid = (wavelen >= 16) & (wavelen <= 64)
    assert mid.any() and bool(((llama3[mid] < base[mid]) & (llama3[mid] > base[mid] / 8)).all())


def test_config_rejects_unsupported_models(tiny_model_dir):
    good = load_model_config(tiny_model_dir)
    assert (good.num_hidden_layers, good.num_queries_per_kv, good.head_dim) == (2, 2, 16)
    assert good.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        parse_model_config({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        parse_model_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        parse_model_config({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="lacks the required field 'vocab_size'"):
        parse_model_config({k: v for k, v in base.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        parse_model_config({**base, "num_key_value_heads": 3})


def test_transformers5_rope_parameters_layout():
    config = parse_model_config(
        {
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1234.0},
        }
    )
    assert config.rope_theta == 1234.0
    assert config.rope_scaling == RopeScaling("linear", 2.0)


def test_generation_config_adds_stop_ids(tiny_model_dir, tmp_path):
    (tmp_path / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    assert load_model_config(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 5, 9]}')
    assert load_model_config(tmp_path).eos_token_ids == (2, 5, 9)
