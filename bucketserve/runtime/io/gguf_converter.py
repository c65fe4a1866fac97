"""Turn a llama.cpp GGUF file into a Hugging Face model directory."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

SUPPORTED_ARCHITECTURES = ("llama",)
# llama.cpp pre-tokenizers that split every digit, then apply the GPT-2 regex.
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
GPT2_PRE = ("gpt-2", "gpt2", "mpt", "olmo", "jais")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
_MISSING = object()

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFConverter:
    """Reads a GGUF (memory-mapped) and writes config, tokenizer and float32 weights."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError) as e:
            raise ValueError(f"{self.path} is not a readable GGUF file: {e}") from e
        self.arch = self.field("general.architecture")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"GGUF architecture {self.arch!r} is not supported; "
                f"supported: {SUPPORTED_ARCHITECTURES}"
            )
        self.tensor_names = {t.name for t in self.reader.tensors}

    def field(self, key: str, default: Any = _MISSING) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            if default is _MISSING:
                raise ValueError(f"GGUF file {self.path.name} lacks metadata {key!r}")
            return default
        return f.contents()

    def _arch_field(self, key: str, default: Any = _MISSING) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def config_dict(self) -> dict[str, Any]:
        """config.json for transformers' LlamaForCausalLM."""
        hidden = self._arch_field("embedding_length")
        heads = self._arch_field("attention.head_count")
        head_dim = self._arch_field("attention.key_length", hidden // heads)
        if self._arch_field("rope.dimension_count", head_dim) != head_dim:
            raise ValueError("GGUF with partial rotary embeddings is not supported")
        if "rope_freqs.weight" in self.tensor_names:
            raise ValueError(
                "GGUF with rope_freqs (Llama-3.1 style rope scaling) is not supported; "
                "use the Hugging Face safetensors directory instead"
            )
        tokens = self.field("tokenizer.ggml.tokens")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self._arch_field("vocab_size", len(tokens)),
            "hidden_size": hidden,
            "intermediate_size": self._arch_field("feed_forward_length"),
            "num_hidden_layers": self._arch_field("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch_field("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self._arch_field("attention.layer_norm_rms_epsilon"),
            "rope_theta": self._arch_field("rope.freq_base", 10000.0),
            "rope_scaling": self._rope_scaling(),
            "max_position_embeddings": self._arch_field("context_length"),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "attention_bias": "blk.0.attn_q.bias" in self.tensor_names,
            "mlp_bias": False,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id", None),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id", None),
            "torch_dtype": "float32",
        }

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._arch_field("rope.scaling.type", "none")
        if kind == "none":
            return None
        if kind != "linear":
            raise ValueError(f"GGUF rope scaling {kind!r} is not supported; only 'linear'")
        return {"rope_type": "linear", "factor": self._arch_field("rope.scaling.factor")}

    def build_tokenizer(self) -> Tokenizer:
        """A `tokenizers` byte-level BPE that tokenizes as llama.cpp does for this file."""
        kind = self.field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer {kind!r} is not supported; only byte-level BPE ('gpt2')"
            )
        tokens = self.field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self.field("tokenizer.ggml.merges")]
        vocab = {token: i for i, token in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = self._pre_tokenizer()
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = self._post_processor(tokens)
        types = self._token_types(tokens)
        tok.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == CONTROL
            ]
        )
        tok.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == USER_DEFINED
            ]
        )
        return tok

    def _token_types(self, tokens: list[str]) -> list[int]:
        return self.field("tokenizer.ggml.token_type", None) or [1] * len(tokens)

    def _pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        pre = self.field("tokenizer.ggml.pre", "gpt-2")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in DIGIT_SPLIT_PRE:
            return pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        if pre in GPT2_PRE:
            return byte_level
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {DIGIT_SPLIT_PRE + GPT2_PRE}"
        )

    def _post_processor(self, tokens: list[str]) -> processors.PostProcessor:
        bos_id = self.field("tokenizer.ggml.bos_token_id", None)
        if not self.field("tokenizer.ggml.add_bos_token", False) or bos_id is None:
            return processors.ByteLevel(trim_offsets=False)
        bos = tokens[bos_id]
        return processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )

    def tokenizer_config(self) -> dict[str, Any]:
        tokens = self.field("tokenizer.ggml.tokens")
        types = self._token_types(tokens)

        def token(key: str) -> str | None:
            i = self.field(f"tokenizer.ggml.{key}", None)
            return None if i is None else tokens[i]

        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": token("bos_token_id"),
            "eos_token": token("eos_token_id"),
            "unk_token": token("unknown_token_id"),
            "pad_token": token("padding_token_id"),
            "additional_special_tokens": [
                t for t, k in zip(tokens, types, strict=True) if k == CONTROL
            ],
            "add_bos_token": bool(self.field("tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": self._arch_field("context_length"),
            "chat_template": self.field("tokenizer.chat_template", None),
        }

    def generation_config(self) -> dict[str, Any]:
        keys = ("bos_token_id", "eos_token_id", "pad_token_id")
        config = self.config_dict()
        return {k: config[k] for k in keys if config[k] is not None}

    def write_tokenizer(self, out_dir: str | Path) -> None:
        """tokenizer.json + tokenizer_config.json only: fast, no weights touched."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.build_tokenizer().save(str(out / "tokenizer.json"))
        _write_json(out / "tokenizer_config.json", self.tokenizer_config())

    def write(self, out_dir: str | Path, progress: bool = True) -> None:
        """A complete HF directory: config, generation config, tokenizer, float32 weights."""
        out = Path(out_dir)
        config = self.config_dict()
        self.check_quant_types()
        self.write_tokenizer(out)
        weights = dict(self.iter_tensors(progress, config))
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        _write_json(out / "generation_config.json", self.generation_config())
        _write_json(out / "config.json", config)  # last: its presence marks a finished dir

    def check_quant_types(self) -> None:
        """Fail fast, before any work, on a tensor type the gguf package can't dequantize."""
        seen: set[gguf.GGMLQuantizationType] = set()
        for t in self.reader.tensors:
            if t.tensor_type in seen:
                continue
            seen.add(t.tensor_type)
            try:
                gguf.quants.dequantize(t.data[:1], t.tensor_type)
            except (NotImplementedError, ValueError, KeyError) as e:
                raise ValueError(
                    f"GGUF tensor {t.name} uses quantization {t.tensor_type.name}, which cannot be "
                    f"dequantized here ({e}); use an F32/F16/BF16/Q8_0/Q4_K-family export"
                ) from e

    def iter_tensors(
        self, progress: bool = False, config: dict[str, Any] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) pairs, with llama.cpp's Q/K row permutation undone."""
        config = config or self.config_dict()
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        tensors = tqdm(
            self.reader.tensors, desc=f"converting {self.path.name}", disable=not progress
        )
        for t in tensors:
            name = _hf_name(t.name)
            shape = tuple(reversed([int(d) for d in t.shape]))
            data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            proj = name.split(".")[-2]
            if proj in heads:
                data = _unpermute(data, heads[proj])
            yield name, torch.from_numpy(np.ascontiguousarray(data))


def _hf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {name!r} has no Llama counterpart")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permute, which interleaves each head's two rotary halves."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
