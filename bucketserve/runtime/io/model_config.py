"""The model's shape, read from a Hugging Face config.json (Llama family)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; `rope_type` is "linear" or "llama3"."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> RopeScaling | None:
        if not d:
            return None
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported; use one of {ROPE_TYPES}"
            )
        if rope_type == "default":
            return None
        if "factor" not in d:
            raise ValueError(f"rope scaling {rope_type!r} needs a 'factor'")
        if rope_type == "linear":
            return cls("linear", float(d["factor"]))
        return cls(
            "llama3",
            float(d["factor"]),
            float(d["low_freq_factor"]),
            float(d["high_freq_factor"]),
            int(d["original_max_position_embeddings"]),
        )


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def num_params(self) -> int:
        """Weights that take part in a forward pass (embedding counted once if tied)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attn = h * self.num_attention_heads * self.head_dim * 2 + h * kv * 2
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embed + h

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no config.json; pass a Hugging Face model directory")
        config = cls.from_dict(json.loads(path.read_text()))
        generation = Path(model_dir) / "generation_config.json"
        if generation.is_file():
            # Chat models often list extra stop ids (e.g. <|eot_id|>) only here.
            extra = _as_ids(json.loads(generation.read_text()).get("eos_token_id"))
            ids = config.eos_token_ids + tuple(i for i in extra if i not in config.eos_token_ids)
            config = dataclasses.replace(config, eos_token_ids=ids)
        return config

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        try:
            return cls._from_dict(d)
        except KeyError as e:
            raise ValueError(f"config.json lacks the required field {e.args[0]!r}") from None

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        if archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {archs[0]!r}; "
                f"this runtime runs {SUPPORTED_ARCHITECTURES}"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported; only 'silu'")
        heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") or {}  # transformers >= 5 layout
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            rope_scaling=RopeScaling.from_dict(d.get("rope_scaling") or rope),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_ids(d.get("eos_token_id")),
            architecture=archs[0],
        )


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
