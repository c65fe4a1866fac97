"""resolve_model, HF safetensors loading and GGUF conversion (synthetic GGUFs + SmolLM2)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.io.default_model import default_gguf_path
from bucketserve.runtime.io.weights import iter_safetensors
from bucketserve.runtime.layers.linear import Linear
from bucketserve.runtime.layers.packing import describe_weights
from bucketserve.runtime.loader.gguf_converter import GGUFConverter, llama3_rope_scaling
from bucketserve.runtime.loader.model_files import convert_gguf, resolve_model
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from tests.conftest import TINY_CONFIG
from tests.gguf_reads import one_parse_per_gguf
from tests.runtime.conftest import SMALL_VOCAB

LINEAR_ROPE = {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}
PROMPT = [19556, 216, 33, 34, 905, 28, 253, 1000, 2000, 3000, 4000]

# HF name -> llama.cpp name, written out independently of the converter's own table.
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused tensors, as its checkpoints store them
    "mlp.gate_up_proj": "ffn_up",
}


def gguf_name(hf: str) -> str:
    if hf in _GGUF_NAMES:
        return _GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Q and K rows."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(path: Path, hf_dir: Path, vocab: dict, arch: str = "llama", **opts) -> Path:
    """A llama.cpp-style GGUF of the HF checkpoint in `hf_dir`.

    opts: qtype (quantize 2-D tensors but those whose names hold one of float_names), pre
    (pre-tokenizer name), f64 (a tensor stored as F64),
    linear_rope (write linear rope scaling x4; default: for llama). Q and K rows are permuted
    as llama.cpp does for llama alone.
    """
    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    if opts.get("linear_rope", arch == "llama"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(opts.get("pre", "smollm"))
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["token_type"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if cfg.get("pad_token_id") is not None:
        w.add_pad_token_id(cfg["pad_token_id"])
    w.add_chat_template(vocab["template"])
    for name, tensor in iter_safetensors(hf_dir):
        data = tensor.numpy()
        if arch == "llama" and (".q_proj.w" in name or ".k_proj.w" in name):
            data = llama_cpp_permute(data, heads if ".q_proj." in name else kv_heads)
        qtype = opts.get("qtype")
        if name == opts.get("f64"):
            w.add_tensor(gguf_name(name), data.astype(np.float64))
        elif qtype is not None and data.ndim == 2 and not any(
            part in name for part in opts.get("float_names", ())
        ):
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), data)
    if opts.get("rope_freqs"):
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_rope_factors(cfg: dict) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf writes as rope_freqs for a llama3 rope scaling:
    each rotary frequency's divisor."""
    rope = cfg.get("rope_scaling") or cfg["rope_parameters"]
    dim, base = cfg["head_dim"], cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_factory, vocab, tmp_path_factory) -> Path:
    """The linear-rope tiny model as an F32 GGUF, written once."""
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(out, tiny_model_factory(**LINEAR_ROPE), vocab)


def small_llama(out: Path, **overrides) -> Path:
    """A seeded linear-rope tiny Llama over the SMALL_VOCAB first tokens, saved in `out`."""
    config = LlamaConfig(**{**TINY_CONFIG, **LINEAR_ROPE, "vocab_size": SMALL_VOCAB, **overrides})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def small_gguf(small_vocab, tmp_path_factory) -> Path:
    """A small-vocabulary tiny model as an F32 GGUF, written once."""
    out = tmp_path_factory.mktemp("small_gguf")
    return write_gguf(out / "small.gguf", small_llama(out / "hf"), small_vocab)


def last_logits(model_dir: Path) -> torch.Tensor:
    runner = ModelRunner(ModelRunnerConfig(model=str(model_dir), block_size=4, num_kv_blocks=8))
    seq = Sequence(PROMPT, SamplingParams(temperature=0))
    seq.block_table = [3, 0, 6]
    return runner.compute_logits([seq], [len(PROMPT)])[0]


def hf_last_logits(model_dir: Path, **kwargs) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0, -1]


def test_gguf_conversion_undoes_llama_cpp_layout(tiny_model_factory, tiny_gguf, vocab, cache_dir):
    hf_dir = tiny_model_factory(**LINEAR_ROPE)
    model_dir = resolve_model(tiny_gguf)
    assert model_dir.parent == cache_dir and model_dir.name.startswith("tiny-")
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert (config["num_key_value_heads"], config["tie_word_embeddings"]) == (2, True)
    expected = hf_last_logits(hf_dir)
    torch.testing.assert_close(last_logits(model_dir), expected, atol=1e-4, rtol=0)
    # The cached directory is a normal HF model for transformers too.
    torch.testing.assert_close(hf_last_logits(model_dir), expected, atol=1e-4, rtol=0)
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    assert hf_tok.encode("Hello 12345") == [19556, 216, 33, 34, 35, 36, 37]
    assert hf_tok.chat_template == vocab["template"]


def test_a_llama3_rope_scaled_gguf_gets_its_scaling_back_from_rope_freqs(
    tiny_model_factory, vocab, cache_dir, tmp_path
):
    """Llama 3.1's files carry their rope scaling only as rope_freqs (per-dimension
    divisors): read back as config.json's llama3 parameters, logits as transformers' on
    the Hugging Face checkpoint."""
    hf_dir = tiny_model_factory()  # llama3 scaling x8 from 64 positions, two dims between
    path = write_gguf(tmp_path / "l31.gguf", hf_dir, vocab, linear_rope=False, rope_freqs=True)
    model_dir = resolve_model(path)
    scaling = json.loads((model_dir / "config.json").read_text())["rope_scaling"]
    want = json.loads((hf_dir / "config.json").read_text())
    want = want.get("rope_scaling") or want["rope_parameters"]
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        assert scaling[key] == pytest.approx(want[key], rel=1e-4), key
    assert scaling["original_max_position_embeddings"] == want["original_max_position_embeddings"]
    torch.testing.assert_close(last_logits(model_dir), hf_last_logits(hf_dir), atol=1e-4, rtol=0)


def test_rope_freqs_no_llama3_scaling_reproduces_are_refused() -> None:
    lone = np.array([1.0, 1.0, 1.0, 3.0, 8.0, 8.0, 8.0, 8.0])  # one dimension between
    with pytest.raises(ValueError, match="no llama3 rope scaling reproduces"):
        llama3_rope_scaling(lone, 10000.0, 16)
    with pytest.raises(ValueError, match="no llama3 rope scaling reproduces"):
        llama3_rope_scaling(np.array([8.0, 1.0] * 4), 10000.0, 16)  # not monotonic
    assert llama3_rope_scaling(np.ones(8), 10000.0, 16) is None


def test_quantized_gguf_dequantizes_close_to_the_original(small_vocab, cache_dir, tmp_path):
    hf_dir = small_llama(tmp_path / "hf")
    path = write_gguf(
        tmp_path / "tiny-q8.gguf", hf_dir, small_vocab, qtype=gguf.GGMLQuantizationType.Q8_0
    )
    original = dict(iter_safetensors(hf_dir))
    converted = dict(iter_safetensors(resolve_model(path)))
    assert converted.keys() == original.keys()
    for name, w in original.items():
        # Q8_0 keeps every value within half a step (max |w| of its 32-block / 127).
        bound = w.abs().max() / 127 if w.dim() == 2 else 0
        assert (converted[name] - w).abs().max() <= bound, name


def test_conversion_is_cached_and_keyed_by_content(small_gguf, small_vocab, cache_dir, tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(small_gguf.read_bytes())
    first = resolve_model(path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(path)) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    write_gguf(path, small_llama(tmp_path / "hf", rms_norm_eps=1e-6), small_vocab)
    assert resolve_model(path) != first


def test_failed_conversion_leaves_no_cache(small_gguf, cache_dir, monkeypatch):
    def crash(self, out, progress=True, keep_blocks=False):
        (Path(out) / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(GGUFConverter, "write", crash)
    with pytest.raises(RuntimeError, match="killed"):
        convert_gguf(small_gguf)
    assert list(cache_dir.iterdir()) == []


@pytest.mark.parametrize(
    ("arch", "opts", "message"),
    [
        ("llama", {"f64": "model.norm.weight"}, "output_norm.weight uses quantization F64"),
        ("llama", {"pre": "chatglm-bpe"}, "GGUF pre-tokenizer 'chatglm-bpe' is not supported"),
    ],
)
def test_unsupported_gguf_is_rejected_before_caching(
    small_vocab, cache_dir, tmp_path, arch, opts, message
):
    hf_dir = small_llama(tmp_path / "hf")
    path = write_gguf(tmp_path / "bad.gguf", hf_dir, small_vocab, arch, **opts)
    with pytest.raises(ValueError, match=message):
        resolve_model(path)
    assert not cache_dir.exists() or list(cache_dir.iterdir()) == []


def test_unsupported_architecture_is_rejected(cache_dir, tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    supported = "'llama', 'qwen2', 'qwen3', 'gemma3', 'phi3'"
    refusal = rf"'falcon' is not supported; supported: \({supported}\)"
    with pytest.raises(ValueError, match=refusal):
        resolve_model(path)
    assert not cache_dir.exists()


def test_bad_model_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"has no config\.json"):
        resolve_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        resolve_model(tmp_path / "weights.bin")
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        resolve_model(tmp_path / "broken.gguf")


def test_sharded_checkpoint_loads_like_a_single_file(tiny_model_dir, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="1MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    torch.testing.assert_close(last_logits(sharded), last_logits(tiny_model_dir), atol=0, rtol=0)


def test_incomplete_checkpoint_is_rejected(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (partial / name).write_bytes((tiny_model_dir / name).read_bytes())
    weights = {k: v for k, v in iter_safetensors(tiny_model_dir) if "layers.1.mlp.up_proj" not in k}
    save_file(weights, str(partial / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"checkpoint lacks weights for .*layers\.1\.mlp\.gate_up_proj"
    ):
        last_logits(partial)
    os.remove(partial / "model.safetensors")
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        last_logits(partial)


@pytest.mark.smollm
def test_smollm_conversion_matches_transformers_gguf_loader(smollm_dir, smollm_gguf_reads):
    config = json.loads((smollm_dir / "config.json").read_text())
    expected = {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected
    gguf_path = default_gguf_path()
    with one_parse_per_gguf(smollm_gguf_reads):
        reference = hf_last_logits(gguf_path.parent, gguf_file=gguf_path.name)
    ours = last_logits(smollm_dir)
    torch.testing.assert_close(ours, reference, atol=2e-3, rtol=0)
    assert int(ours.argmax()) == int(reference.argmax())


def runner_logits(model: Path, quantization: str) -> tuple[ModelRunner, torch.Tensor]:
    config = ModelRunnerConfig(
        model=str(model), block_size=4, num_kv_blocks=8, quantization=quantization
    )
    runner = ModelRunner(config)
    prompt = [1, 33, 34, 200, 28, 253, 100, 300, 5]  # within SMALL_VOCAB
    seq = Sequence(prompt, SamplingParams(temperature=0))
    seq.block_table = [3, 0, 6]
    return runner, runner.compute_logits([seq], [len(prompt)])[0]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_weights_stay_in_their_blocks_close_to_the_float_expansion(
    small_vocab, cache_dir, tmp_path, qtype
):
    kind = gguf.GGMLQuantizationType[qtype]
    path = write_gguf(tmp_path / "q.gguf", small_llama(tmp_path / "hf"), small_vocab, qtype=kind)
    kept, logits = runner_logits(path, "auto")
    _, reference = runner_logits(path, "none")
    model = kept.model.model
    linears = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert linears and all(m.blocks and m.weight.numel() == 0 for m in linears)
    assert model.embed_tokens.blocks.parts[0].block_type == qtype  # the tied head reads it
    assert kept.model.lm_head.gemm_weight is model.embed_tokens.blocks
    formats, resident = describe_weights(kept.model)
    assert formats == f"{qtype} x 11, float32 x 5"  # qkv, o, gate, up, down a layer, the table
    float_bytes = sum(t.numel() * 4 for _, t in iter_safetensors(tmp_path / "hf"))
    assert resident < float_bytes / 3
    # x goes through the GEMMs in 8 bits, each value within amax / 254 of its block: ~0.5 %
    # of a GEMM's output (test_block_gemm), compounded over the layers' GEMMs and the head
    # in sequence; measured 1.7 % (Q8_0) and 3.4 % (Q4_1) here.
    assert (logits - reference).norm() / reference.norm() < 0.06
    assert logits.argmax() == reference.argmax()


def test_a_stacked_weight_stays_in_blocks_only_when_all_its_parts_share_a_type(
    small_vocab, tmp_path
):
    path = write_gguf(
        tmp_path / "mixed.gguf", small_llama(tmp_path / "hf"), small_vocab,
        qtype=gguf.GGMLQuantizationType.Q8_0, float_names=("v_proj", "up_proj"),
    )  # fmt: skip
    kept = GGUFConverter(path).kept_blocks()
    assert {name.split(".", 2)[-1] for name in kept if name.startswith("blk.")} == {
        "attn_output.weight", "ffn_down.weight",
    }  # fmt: skip
    assert "token_embd.weight" in kept
