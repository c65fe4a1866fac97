"""The model's shape, read from a Hugging Face config.json: the fields every family shares
here, the family's own from its declaration (`runtime/models/registry.py` parses)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")
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
    """What the model families read. `layer_types`: each layer's "full_attention" or
    "sliding_attention" (a window of `sliding_window` tokens); `rope_local_theta`: the
    rope base of sliding layers where it differs (Gemma 3). The OPT fields:
    `do_layer_norm_before` (pre- or post-norm layers), `final_layer_norm`,
    `word_embed_proj_dim` (embeddings narrower than the hidden size, projected in and out)."""

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
    hidden_act: str = "silu"
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    layer_norm_eps: float = 1e-5
    layer_norm_elementwise_affine: bool = True
    do_layer_norm_before: bool = True
    final_layer_norm: bool = True
    word_embed_proj_dim: int | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} unknown; use {LAYER_TYPES}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of decoder layer `layer`; None: every earlier token."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def num_params(self) -> int:
        """Weights that take part in a forward pass (embedding counted once if tied;
        biases left out)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attn = h * self.num_attention_heads * self.head_dim * 2 + h * kv * 2
        mlp_matrices = 2 if self.architecture == "OPTForCausalLM" else 3
        layer = attn + mlp_matrices * h * self.intermediate_size + 2 * h
        embed_dim = self.word_embed_proj_dim or h
        embed = self.vocab_size * embed_dim * (1 if self.tie_word_embeddings else 2)
        if embed_dim != h:
            embed += 2 * embed_dim * h
        if self.architecture == "OPTForCausalLM":
            embed += (self.max_position_embeddings + 2) * h
        return self.num_hidden_layers * layer + embed + h

    @classmethod
    def from_dict(
        cls,
        d: dict[str, Any],
        architecture: str,
        family: dict[str, Any],
        activations: tuple[str, ...],
    ) -> ModelConfig:
        """The config of config.json `d` (a missing required field: KeyError): the fields
        every family shares, then `family`'s own (`ModelFamily.config_fields`)."""
        act = family.get("hidden_act", "silu")
        if act not in activations:
            raise ValueError(
                f"hidden_act {act!r} is not supported for {architecture}; use one of {activations}"
            )
        heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") or {}  # transformers >= 5 layout
        fields: dict[str, Any] = {
            "vocab_size": d["vocab_size"],
            "hidden_size": d["hidden_size"],
            "intermediate_size": family.get("intermediate_size") or d["intermediate_size"],
            "num_hidden_layers": d["num_hidden_layers"],
            "num_attention_heads": heads,
            "num_key_value_heads": d.get("num_key_value_heads") or heads,
            "head_dim": d.get("head_dim") or d["hidden_size"] // heads,
            "rms_norm_eps": d.get("rms_norm_eps", 1e-6),
            "rope_theta": float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            "rope_scaling": RopeScaling.from_dict(d.get("rope_scaling") or rope),
            "max_position_embeddings": d.get("max_position_embeddings", 2048),
            "tie_word_embeddings": d.get("tie_word_embeddings", False),
            "attention_bias": d.get("attention_bias", False),
            "mlp_bias": d.get("mlp_bias", False),
            "bos_token_id": d.get("bos_token_id"),
            "eos_token_ids": _as_ids(d.get("eos_token_id")),
            "architecture": architecture,
        }
        fields.update(family)
        if fields.get("sliding_window") is None:
            fields["layer_types"] = ()
        return cls(**fields)


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """A model directory's config.json, its `eos_token_id` joined by those of
    generation_config.json (chat models often list extra stop ids, e.g. <|eot_id|>, there
    alone)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json; pass a Hugging Face model directory")
    d = json.loads(path.read_text())
    generation = Path(model_dir) / "generation_config.json"
    if generation.is_file():
        ids = _as_ids(d.get("eos_token_id"))
        extra = _as_ids(json.loads(generation.read_text()).get("eos_token_id"))
        d["eos_token_id"] = [*ids, *(i for i in extra if i not in ids)]
    return d


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
