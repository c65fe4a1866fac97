"""Turn a llama.cpp GGUF file into a Hugging Face model directory, as its family's
`GGUFLayout` says."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from bucketserve.runtime.io.gguf_file import GGUFFile
from bucketserve.runtime.io.gguf_tokenizer import GGUFTokenizer
from bucketserve.runtime.io.model_config import RopeScaling
from bucketserve.runtime.io.quantized import BLOCK_TYPES, QuantizedTensor
from bucketserve.runtime.layers.rotary_embedding import rope_inv_freq
from bucketserve.runtime.models.registry import gguf_family

_MISSING = object()

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's rope scaling, as per-dimension factors
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# The tensors one GEMM weight stacks (model files' stacked_params): they stay in blocks
# together or not at all.
_STACKED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
# The matrices a block-kept weight may be: the GEMMs, the head and the token table.
_BLOCK_TENSORS = re.compile(
    r"token_embd\.weight|output\.weight|blk\.\d+\.(attn_[qkv]|attn_qkv|attn_output|ffn_\w+)\.weight"
)


class GGUFConverter:
    """Reads a GGUF (memory-mapped) and writes config, tokenizer and float32 weights."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        self.arch = self.field("general.architecture")
        self.family = gguf_family(self.arch)
        self.layout = self.family.gguf
        self.tensor_names = set(self.file.tensors)
        self.tokenizer = GGUFTokenizer(self.field, self.arch)

    def field(self, key: str, default: Any = _MISSING) -> Any:
        value = self.file.fields.get(key, default)
        if value is _MISSING:
            raise ValueError(f"GGUF file {self.path.name} lacks metadata {key!r}")
        return value

    def _arch_field(self, key: str, default: Any = _MISSING) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def config_dict(self) -> dict[str, Any]:
        """config.json of the family's Hugging Face architecture."""
        hidden = self._arch_field("embedding_length")
        heads = self._arch_field("attention.head_count")
        head_dim = self._arch_field("attention.key_length", hidden // heads)
        if self._arch_field("rope.dimension_count", head_dim) != head_dim:
            raise ValueError("GGUF with partial rotary embeddings is not supported")
        if any(name.startswith("rope_factors") for name in self.tensor_names):
            raise ValueError("GGUF with rope_factors (LongRoPE, Phi-3 128k) is not supported")
        common = {
            "vocab_size": self._arch_field("vocab_size", len(self.tokenizer.tokens)),
            "hidden_size": hidden,
            "intermediate_size": self._arch_field("feed_forward_length"),
            "num_hidden_layers": self._arch_field("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch_field("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": self._arch_field("attention.layer_norm_rms_epsilon"),
            "rope_scaling": self._rope_scaling(head_dim),
            "max_position_embeddings": self._arch_field("context_length"),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "attention_bias": "blk.0.attn_q.bias" in self.tensor_names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id", None),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id", None),
            "torch_dtype": "float32",
        }
        return {
            "architectures": [self.family.architectures[0]],
            "model_type": self.family.model_type,
            **common,
            **self.layout.config(self._arch_field, common),
        }

    def _rope_scaling(self, head_dim: int) -> dict[str, Any] | None:
        kind = self._arch_field("rope.scaling.type", "none")
        if kind == "none" and ROPE_FREQS in self.tensor_names:
            t = self.file.tensors[ROPE_FREQS]
            factors = gguf.quants.dequantize(t.data, t.type).astype(np.float64).reshape(-1)
            base = self._arch_field("rope.freq_base", 10000.0)
            return llama3_rope_scaling(factors, base, head_dim)
        if kind == "none":
            return None
        if kind != "linear":
            raise ValueError(f"GGUF rope scaling {kind!r} is not supported; only 'linear'")
        return {"rope_type": "linear", "factor": self._arch_field("rope.scaling.factor")}

    def build_tokenizer(self) -> Tokenizer:
        """A `tokenizers` tokenizer that encodes as transformers does with this file."""
        return self.tokenizer.build()

    def tokenizer_config(self) -> dict[str, Any]:
        return self.tokenizer.config(self._arch_field("context_length"))

    def generation_config(self) -> dict[str, Any]:
        keys = ("bos_token_id", "eos_token_id", "pad_token_id")
        config = self.config_dict()
        out = {k: config[k] for k in keys if config[k] is not None}
        # e.g. Gemma's <end_of_turn>: a stop token for llama.cpp and in the Hugging Face
        # checkpoints, though the file names only <eos>
        turn_end = self.layout.turn_end
        if turn_end is not None and turn_end in self.tokenizer.tokens:
            eos = config["eos_token_id"]
            out["eos_token_id"] = [
                *([] if eos is None else [eos]),
                self.tokenizer.tokens.index(turn_end),
            ]
        return out

    def write_tokenizer(self, out_dir: str | Path) -> None:
        """tokenizer.json + tokenizer_config.json only: no weights touched."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.build_tokenizer().save(str(out / "tokenizer.json"))
        _write_json(out / "tokenizer_config.json", self.tokenizer_config())

    def write(self, out_dir: str | Path, progress: bool = True, keep_blocks: bool = False) -> None:
        """A complete HF directory: config, generation config, tokenizer, float32 weights;
        with `keep_blocks`, the GEMM weights of a type the CPU kernels multiply
        (`kept_blocks`) as their quantized blocks (uint8), their types in the safetensors
        metadata (`block_types`)."""
        out = Path(out_dir)
        config = self.config_dict()
        self.tokenizer.check()
        self.check_quant_types()
        self.write_tokenizer(out)
        weights, block_types = {}, {}
        for name, tensor in self.iter_tensors(progress, config, keep_blocks):
            if isinstance(tensor, QuantizedTensor):
                block_types[name], tensor = tensor.block_type, tensor.blocks
            weights[name] = tensor
        metadata = {"format": "pt", "block_types": json.dumps(block_types)}
        save_file(weights, str(out / "model.safetensors"), metadata=metadata)
        _write_json(out / "generation_config.json", self.generation_config())
        _write_json(out / "config.json", config)  # last: its presence marks a finished dir

    def check_quant_types(self) -> None:
        """Fail fast, before any work, on a tensor type the gguf package can't dequantize."""
        seen: set[gguf.GGMLQuantizationType] = set()
        for t in self.file.tensors.values():
            if t.type in seen:
                continue
            seen.add(t.type)
            try:
                gguf.quants.dequantize(t.data[: gguf.GGML_QUANT_SIZES[t.type][1]], t.type)
            except (NotImplementedError, ValueError, KeyError) as e:
                raise ValueError(
                    f"GGUF tensor {t.name} uses quantization {t.type.name}, which cannot be "
                    f"dequantized here ({e}); use an F32/F16/BF16/Q8_0/Q4_K-family export"
                ) from e

    def kept_blocks(self) -> set[str]:
        """The GGUF tensors that can stay in their blocks: GEMM weights (and the token
        table) of a type in `BLOCK_TYPES`, with all the tensors stacked with them."""
        types = {n: t.type.name for n, t in self.file.tensors.items()}
        kept = {
            n for n, kind in types.items() if kind in BLOCK_TYPES and _BLOCK_TENSORS.fullmatch(n)
        }
        for name in list(kept):
            m = _LAYER_RE.fullmatch(name)
            group = next((g for g in _STACKED if m and m.group(2) in g), ())
            members = [f"blk.{m.group(1)}.{part}.weight" for part in group]
            # a part the file has not (Phi-3's gate, fused into ffn_up) holds nothing back
            if any(other in types and types[other] not in BLOCK_TYPES for other in members):
                kept.discard(name)
        return kept

    def iter_tensors(
        self,
        progress: bool = False,
        config: dict[str, Any] | None = None,
        keep_blocks: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """(HF name, float32 tensor) pairs in the Hugging Face layout: llama.cpp's Q/K row
        permutation undone (`GGUFLayout.permuted_qk`), its 1 + w norm weights back to w
        (`unit_offset_norms`). With `keep_blocks`, the `kept_blocks` tensors come
        as their blocks (rows permuted alike)."""
        config = config or self.config_dict()
        kept = self.kept_blocks() if keep_blocks else set()
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        tensors = tqdm(
            self.file.tensors.values(), desc=f"converting {self.path.name}", disable=not progress
        )
        for t in tensors:
            if t.name == ROPE_FREQS:  # in config.json's rope_scaling
                continue
            name = self._hf_name(t.name)
            if t.name in kept:
                data = np.array(t.data).reshape(t.shape[0], -1)
            else:
                data = gguf.quants.dequantize(t.data, t.type).reshape(t.shape).astype(np.float32)
            proj = name.split(".")[-2]
            if self.layout.permuted_qk and proj in heads:
                data = _unpermute(data, heads[proj])
            if self.layout.unit_offset_norms and name.endswith("norm.weight"):
                data = data - np.float32(1)
            tensor = torch.from_numpy(np.ascontiguousarray(data))
            yield name, QuantizedTensor(tensor, t.type.name) if t.name in kept else tensor

    def _hf_name(self, name: str) -> str:
        if name in _TOP_NAMES:
            return _TOP_NAMES[name]
        layer_names = self.layout.layer_names
        m = _LAYER_RE.fullmatch(name)
        if m is None or m.group(2) not in layer_names:
            raise ValueError(f"GGUF tensor {name!r} has no Hugging Face {self.arch} counterpart")
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def llama3_rope_scaling(factors: np.ndarray, base: float, head_dim: int) -> dict[str, Any] | None:
    """The `llama3` rope scaling (config.json's form) whose per-dimension divisors of the
    rotary frequencies llama.cpp's converter wrote as `rope_freqs`: 1 for the short
    wavelengths, `factor` for the long ones and, between, `1 / ((1 - s) / factor + s)` with
    `s = original / wavelength / (high - low) - low / (high - low)` linear in 1 / wavelength.
    Only that line is determined (`low` = 1 is taken), which is all the frequencies use.
    Divisors no such scaling reproduces are refused."""
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    plain = rope_inv_freq(head_dim, base, None).double().numpy()
    wavelen = 2 * np.pi / plain
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)  # 1: kept, 0: divided by factor
    mid = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    if mid.sum() >= 2:
        slope, intercept = np.polyfit(1 / wavelen[mid], smooth[mid], 1)
        high, original = 1 - 1 / intercept, -slope / intercept
    else:  # a step: both ends of the line between the last kept and the first divided one
        kept, scaled = wavelen[smooth >= 1 - 1e-4], wavelen[smooth <= 1e-4]
        original = math.floor(scaled.min())
        high = original / (kept.max() if kept.size else original / 2) / (1 + 1e-6)
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": float(high),
        "original_max_position_embeddings": round(float(original)),
    }
    scaled = rope_inv_freq(head_dim, base, RopeScaling.from_dict(scaling)).double().numpy()
    if not np.allclose(scaled, plain / factors, rtol=1e-3):
        raise ValueError(
            "GGUF rope_freqs that no llama3 rope scaling reproduces are not supported; "
            "use the Hugging Face safetensors directory instead"
        )
    return scaling


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permute, which interleaves each head's two rotary halves."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
