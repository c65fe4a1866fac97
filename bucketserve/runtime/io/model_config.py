"""The model's shape, read from a Hugging Face config.json (the families in
`SUPPORTED_ARCHITECTURES`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "OPTForCausalLM",
)
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
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
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; "
                f"this runtime runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "OPTForCausalLM":
            family = _opt_fields(d)
        elif arch == "Gemma3ForCausalLM":
            family = _gemma3_fields(d)
        else:
            family = _llama_like_fields(d, arch)
        act = family.get("hidden_act", "silu")
        allowed = ("relu",) if arch == "OPTForCausalLM" else GATED_ACTIVATIONS
        if act not in allowed:
            raise ValueError(
                f"hidden_act {act!r} is not supported for {arch}; use one of {allowed}"
            )
        heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") or {}  # transformers >= 5 layout
        fields: dict[str, Any] = {
            "vocab_size": d["vocab_size"],
            "hidden_size": d["hidden_size"],
            "intermediate_size": d["ffn_dim" if arch == "OPTForCausalLM" else "intermediate_size"],
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
            "architecture": arch,
        }
        fields.update(family)
        if fields["sliding_window"] is None:
            fields["layer_types"] = ()
        return cls(**fields)


def _llama_like_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """Llama, Mistral (one window for every layer), Qwen2 and Qwen3 (a window from layer
    `max_window_layers` on, where `use_sliding_window` turns it on)."""
    window = d.get("sliding_window")
    layers = d["num_hidden_layers"]
    if arch == "LlamaForCausalLM":
        window = None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not d.get("use_sliding_window", False):
            window = None
        first = d.get("max_window_layers", layers)
        default_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)
        ]
    else:
        default_types = ["sliding_attention"] * layers
    return {
        "hidden_act": d.get("hidden_act", "silu"),
        "sliding_window": window,
        "layer_types": tuple(d.get("layer_types") or default_types),
    }


def _gemma3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 (text): interleaved sliding and global layers with rope bases of their own,
    either as transformers 4 writes them (`rope_local_base_freq`, `rope_scaling` for the
    global layers) or 5 (`rope_parameters` per layer type)."""
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 2 style attention)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported: decoders are causal")
    layers = d["num_hidden_layers"]
    types = d.get("layer_types")
    if not types:
        pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    rope = d.get("rope_parameters") or {}
    full = rope.get("full_attention") or {}
    local = rope.get("sliding_attention") or {}
    if RopeScaling.from_dict(local) is not None:
        raise ValueError("rope scaling on Gemma 3's sliding-window layers is not supported")
    heads = d["num_attention_heads"]
    return {
        "hidden_act": d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        "tie_word_embeddings": d.get("tie_word_embeddings", True),
        "sliding_window": d.get("sliding_window"),
        "layer_types": tuple(types),
        "rope_theta": float(full.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
        "rope_scaling": RopeScaling.from_dict(d.get("rope_scaling") or full),
        "rope_local_theta": float(local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))),
        "query_pre_attn_scalar": float(
            d.get("query_pre_attn_scalar") or d.get("head_dim") or d["hidden_size"] // heads
        ),
        "final_logit_softcapping": d.get("final_logit_softcapping"),
    }


def _opt_fields(d: dict[str, Any]) -> dict[str, Any]:
    """OPT: learned positions, LayerNorm, a ReLU MLP, biases; no rotary embedding."""
    bias = d.get("enable_bias", True)
    pre_norm = d.get("do_layer_norm_before", True)
    heads = d["num_attention_heads"]
    return {
        "intermediate_size": d["ffn_dim"],
        "num_key_value_heads": heads,
        "head_dim": d["hidden_size"] // heads,
        "hidden_act": d.get("activation_function", "relu"),
        "tie_word_embeddings": d.get("tie_word_embeddings", True),
        "attention_bias": bias,
        "mlp_bias": bias,
        "rope_scaling": None,
        "sliding_window": None,
        "layer_types": (),
        "layer_norm_elementwise_affine": d.get("layer_norm_elementwise_affine", True),
        "do_layer_norm_before": pre_norm,
        "final_layer_norm": pre_norm and not d.get("_remove_final_layer_norm", False),
        "word_embed_proj_dim": d.get("word_embed_proj_dim") or d["hidden_size"],
    }


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
