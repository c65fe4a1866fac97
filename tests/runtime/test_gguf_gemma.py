"""Gemma 3 GGUFs: a tiny one written here the way llama.cpp writes them, and the real
Gemma 3 270M (Q4_K / Q5_0 / Q6_K / Q8_0) against transformers loading the same file."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.io.weights import iter_safetensors
from bucketserve.runtime.loader.model_files import convert_gguf
from tests.gguf_reads import one_parse_per_gguf

# HF name -> llama.cpp name, written out independently of the converter's own table.
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
CONTROL, USER_DEFINED, BYTE = 3, 4, 6
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
# "  " and "   " are stored with real spaces, as in Gemma's files; "bc" comes before "ab",
# so "abc" is "a" + "bc" by file order, though the scores below rank "ab" higher.
WORDS = ["\u2581", "a", "b", "c", "h", "i", "bc", "ab", "\u2581a", "\u2581h", "hi", "\u2581hi"]
TINY_TEXTS = ["abc", "hi abc", "  hi", "a\nb  c", "hi   there", "<start_of_turn>hi", "é", ""]
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "  leading spaces\tand\ttabs\n\n\nnewlines 1234567 ünïcödé 日本語 🤖",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
]


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = [*SPECIALS, "\n", "  ", "   ", *(f"<0x{b:02X}>" for b in range(256)), *WORDS]
    types = [CONTROL] * len(SPECIALS) + [USER_DEFINED] * 3 + [BYTE] * 256 + [1] * len(WORDS)
    return tokens, types


def gguf_name(hf: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF dir, GGUF): a seeded random 7-layer Gemma 3 and its llama.cpp-style GGUF, norm
    weights stored as 1 + w."""
    tokens, types = tiny_vocab()
    config = Gemma3TextConfig(
        vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=7,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    out = tmp_path_factory.mktemp("tiny_gemma")
    hf_dir = out / "hf"
    model.save_pretrained(hf_dir)
    path = out / "tiny-gemma.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(7)
    w.add_context_length(128)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(8)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([float(i) for i in range(len(tokens))])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for name, tensor in iter_safetensors(hf_dir):
        data = tensor.numpy()
        if name.endswith("norm.weight"):
            data = data + np.float32(1)
        w.add_tensor(gguf_name(name), data)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return hf_dir, path


def test_tiny_gemma3_gguf_converts_back_to_its_checkpoint(tiny_gemma, tmp_path):
    hf_dir, path = tiny_gemma
    model_dir = convert_gguf(path, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    sliding, full = "sliding_attention", "full_attention"
    assert config["layer_types"] == [sliding] * 5 + [full, sliding]
    want = {"sliding_window": 8, "query_pre_attn_scalar": 16, "head_dim": 16,
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}  # fmt: skip
    assert {k: config[k] for k in want} == want
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == [1, 6]
    original, converted = dict(iter_safetensors(hf_dir)), dict(iter_safetensors(model_dir))
    assert converted.keys() == original.keys() - {"lm_head.weight"}
    for name, weight in converted.items():  # (1 + w) - 1 rounds in the last place
        torch.testing.assert_close(weight, original[name], atol=1e-6, rtol=0, msg=name)
    ids = torch.tensor([[2, 277, 276, 274, 8, 275, 270]])
    with torch.no_grad():
        want_logits = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(got, want_logits, atol=1e-5, rtol=0)


def test_gemma_sentencepiece_vocab_tokenizes_like_transformers(tiny_gemma, tmp_path):
    """Merges by file order, space tokens respelled with "▁", byte fallback, BOS added,
    control tokens whole: what transformers builds from the same file."""
    _, path = tiny_gemma
    model_dir = convert_gguf(path, tmp_path)
    ours = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokens, _ = tiny_vocab()
    for text in TINY_TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert [tokens[i] for i in ours.encode("abc").ids] == ["<bos>", "a", "bc"]
    assert [tokens[i] for i in ours.encode("  hi").ids] == ["<bos>", "  ", "hi"]
    assert ours.decode(ours.encode("hi   é").ids) == "hi   é"  # é by its two bytes
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == (
        "<bos>", "<eos>", True)  # fmt: skip
    assert config["chat_template"] is None


# -- the real Gemma 3 270M ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_gemma(gemma_gguf: Path):
    """transformers' own GGUF loader: the reference model (float32) and tokenizer."""
    with one_parse_per_gguf():
        model = AutoModelForCausalLM.from_pretrained(
            gemma_gguf.parent, gguf_file=gemma_gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gemma_gguf.parent, gguf_file=gemma_gguf.name)
    return model.eval(), tokenizer


@pytest.mark.gemma
def test_gemma_conversion_matches_transformers_gguf_loader(gemma_dir, hf_gemma):
    hf_model, theirs = hf_gemma
    config = json.loads((gemma_dir / "config.json").read_text())
    want = {
        "num_hidden_layers": 18, "hidden_size": 640, "intermediate_size": 2048,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "vocab_size": 262144, "sliding_window": 512, "query_pre_attn_scalar": 256,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
    }  # fmt: skip
    assert {k: config[k] for k in want} == want
    assert config["layer_types"] == list(hf_model.config.layer_types)
    reference = hf_model.state_dict()
    converted = dict(iter_safetensors(gemma_dir))
    assert converted.keys() == reference.keys() - {"lm_head.weight"}
    for name, weight in converted.items():
        assert torch.equal(weight, reference[name]), name
    ours = tokenizers.Tokenizer.from_file(str(gemma_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    # ~600 tokens: the sliding layers see only the last 512
    " ".join(f"Item {i} is a {('red', 'green', 'blue')[i % 3]} box." for i in range(66))
    + " The last item is",
]


@pytest.mark.gemma
def test_gemma_greedy_output_equals_transformers_on_the_same_gguf(gemma_gguf, hf_gemma):
    """The float32 expansion's greedy tokens are transformers'; with the file's blocks kept
    (Q5_0 / Q8_0 / Q4_K / Q6_K, q and k in Q5_0 stacked with v in Q8_0: every matrix, a
    quarter of the memory) x in 8 bits leaves these prompts' greedy tokens as they are."""
    from bucketserve.runtime.engine.llm import LLM

    hf_model, _ = hf_gemma
    params = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(str(gemma_gguf), num_kv_blocks=256, quantization="none")
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(outputs[-1].prompt_token_ids) > 512 + 64
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            want = hf_model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
        assert list(out.token_ids) == want.tolist(), prompt
    assert "France" in outputs[0].text
    kept = LLM(str(gemma_gguf), num_kv_blocks=256)  # quantization "auto", the default
    runner = kept.engine.runner
    assert runner.weight_formats == "float32 x 109, Q5_0 x 54, Q4_K x 27, Q8_0 x 10, Q6_K x 9"
    assert runner.weight_bytes < 256 * 2**20  # the float32 expansion: 1023 MiB
    blocks = kept.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in blocks] == [o.token_ids for o in outputs]
