"""Transformer shapes the cost model needs, for the paper's models and the calibration model."""

from __future__ import annotations

from dataclasses import dataclass

from bucketserve.utils.checks import check_int


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. `gated_mlp`: SwiGLU (3 matrices, Llama) vs 2 (OPT)."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn: int
    vocab: int
    max_len: int
    bytes_per_param: int = 2
    gated_mlp: bool = True
    tie_embeddings: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn", "vocab"):
            check_int(f"{self.name}: {name}", getattr(self, name), 1)
        check_int(f"{self.name}: max_len", self.max_len, 2)
        check_int(f"{self.name}: bytes_per_param", self.bytes_per_param, 1)
        if self.hidden % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: hidden ({self.hidden}) must divide into num_heads "
                f"({self.num_heads}), and num_heads into num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def layer_params(self) -> int:
        """Matmul weights of one layer (norms and biases are noise at this scale)."""
        kv = self.num_kv_heads * self.head_dim
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv
        return attention + (3 if self.gated_mlp else 2) * self.hidden * self.ffn

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def num_params(self) -> int:
        embeddings = self.lm_head_params * (1 if self.tie_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """Eq. 1 for one token: 2 (K and V) x layers x KV heads x head dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "llama-2-7b",
            32,
            4096,
            32,
            32,
            11008,
            32000,
            4096,
            source="Llama 2 paper / HF config: 32 layers, 4096 hidden, 32 heads, FFN 11008",
        ),
        ModelSpec(
            "llama-2-13b",
            40,
            5120,
            40,
            40,
            13824,
            32000,
            4096,
            source="Llama 2 paper / HF config: 40 layers, 5120 hidden, 40 heads, FFN 13824",
        ),
        ModelSpec(
            "opt-13b",
            40,
            5120,
            40,
            40,
            20480,
            50272,
            2048,
            gated_mlp=False,
            tie_embeddings=True,
            source="OPT paper / HF config: 40 layers, 5120 hidden, 40 heads, FFN 20480, ReLU",
        ),
        ModelSpec(
            "smollm2-135m",
            30,
            576,
            9,
            3,
            1536,
            49152,
            8192,
            bytes_per_param=4,
            tie_embeddings=True,
            source="the embedded SmolLM2-135M-Instruct config, run in float32",
        ),
    )
}
