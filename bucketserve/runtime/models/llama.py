"""Llama-family decoder in plain torch, over a flat token batch and the paged KV pool."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from bucketserve.runtime.cpu import kernels
from bucketserve.runtime.cpu.graph_ops import paged_decode_flat, paged_prefill_rect
from bucketserve.runtime.io.model_config import ModelConfig, RopeScaling
from bucketserve.runtime.worker.attention import (
    AttentionMetadata,
    attend_flat,
    attend_rect,
    paged_attention,
    rect_mask,
    write_kv,
    write_slots,
)
from bucketserve.runtime.worker.device import (
    Weight,
    cpu_gemm_backend,
    linear,
    linear_add,
    linear_silu_mul,
    pack_graph_weight,
    pack_weight,
    prefill_gemm_rows,
)
from bucketserve.runtime.worker.kv_cache import KVCache

# (q [T, heads, dim], k, v [T, kv_heads, dim], scale) -> attention output [T, heads, dim]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

# checkpoint name fragment -> (our fused parameter, shard index)
STACKED_PARAMS = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class Linear(nn.Linear):
    """`nn.Linear` whose GEMM may read a packed copy of its weight (`pack`), split into
    `parts` row blocks when the GEMMs use parts of it (gate and up)."""

    packed: tuple[Weight, ...] | None = None

    def pack(
        self,
        batch_hint: int,
        backend: str,
        parts: int = 1,
        large_rows: int | None = None,
        graphs: bool = False,
    ) -> None:
        """From now on the GEMMs read packed copies (`pack_weight`, or `pack_graph_weight`
        for compiled graphs), and the plain weight is dropped (it would double the layer's
        memory) unless packing kept it as it was."""
        chunks = self.weight.chunk(parts)
        pack = pack_graph_weight if graphs else pack_weight
        self.packed = tuple(pack(w, batch_hint, backend, large_rows) for w in chunks)
        if all(p is not w for p, w in zip(self.packed, chunks, strict=True)):
            self.weight = nn.Parameter(self.weight.new_empty((0, self.in_features)), False)

    def gemm_weights(self, parts: int = 1) -> tuple[Weight, ...]:
        return self.packed if self.packed is not None else self.weight.chunk(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.gemm_weights()[0], self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = kernels.for_tensors(x.dtype, x.device)
        if kernel and x.is_contiguous() and self.weight.dtype == x.dtype:
            return kernel.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    old_len = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin table for every position; looked up once per step."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.register_buffer("cos_sin", self._table(), persistent=False)

    def _table(self) -> torch.Tensor:
        c = self.config
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # sin carries rotate_half's sign: rotate_half(x) * sin == x.roll(half) * signed_sin
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos, -sin, sin), dim=-1)

    def reset(self) -> None:
        """Refill the table (after `to_empty`); computed in float32 on the CPU."""
        with torch.device("cpu"):
            table = self._table()
        self.cos_sin.copy_(table)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`[T, 1, 2 * head_dim]` (cos | signed sin) for the step's positions."""
        return self.cos_sin.index_select(0, positions).to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Llama's (neox-style) rotary embedding of `x [T, heads, head_dim]`: in place where
    the CPU kernel runs, else a new tensor."""
    kernel = kernels.for_tensors(x.dtype, x.device)
    if (
        kernel
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cos_sin.is_contiguous()
        and cos_sin.dtype == x.dtype
    ):
        return kernel.rope_(x, cos_sin)
    return rope_reference(x, cos_sin)


def rope_reference(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in torch ops, into a new tensor."""
    cos, signed_sin = cos_sin.chunk(2, dim=-1)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        cos_sin: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        """`residual + attention(x)`; `attend` writes K/V to the cache and attends."""
        tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = apply_rope(qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos_sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = attend(q, k, v, self.scale)
        o_proj = self.o_proj
        weight = o_proj.gemm_weights()[0]
        return linear_add(out.reshape(tokens, self.q_size), weight, residual, o_proj.bias)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + down(silu(gate(x)) * up(x))`: three GEMMs with the rest fused in."""
        gate, up = self.gate_up_proj.gemm_weights(2)
        h = linear_silu_mul(x, gate, up)
        return linear_add(h, self.down_proj.gemm_weights()[0], residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def gemms(self) -> tuple[tuple[Linear, int], ...]:
        """The layer's Linears, each with the number of row blocks its GEMMs use."""
        attn, mlp = self.self_attn, self.mlp
        return ((attn.qkv_proj, 1), (attn.o_proj, 1), (mlp.gate_up_proj, 2), (mlp.down_proj, 1))

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        """The layer's output; `x`, the residual stream, is consumed (`linear_add`)."""
        x = self.self_attn(self.input_layernorm(x), x, cos_sin, attend)
        return self.mlp(self.post_attention_layernorm(x), x)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, max_positions)


class LlamaForCausalLM(nn.Module):
    """`forward` maps a flat step (`input_ids [T]`, `positions [T]`) to hidden states
    `[T, hidden]`, writing each layer's K/V into the pool on the way;
    `compute_logits` projects only the rows that are sampled."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions or config.max_position_embeddings)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_head: Weight | None = None

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        weights: Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int | None = None,
    ) -> LlamaForCausalLM:
        """Allocate without random init, then fill from `weights` (HF names)."""
        with torch.device("meta"):
            model = cls(config, max_positions)
        model = model.to_empty(device=device).to(dtype)
        model.model.rotary_emb.reset()
        model.load_weights(weights)
        return model.eval().requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        metadata.prepare(self.config.num_queries_per_kv, self.config.head_dim, x.dtype)
        cos_sin = self.model.rotary_emb(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos_sin, paged_attend(*kv_cache.layer(i), metadata))
        return self.model.norm(x)

    # -- the static-shape regions a graph compiler takes (runtime/worker/compiled_graphs.py) --

    def graph_head(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_positions: torch.Tensor | None = None,
        num_keys: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Embeddings, rope table rows and the rectangle's mask of a padded step (no mask
        for a flat decode step)."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.model.rotary_emb(positions, x.dtype)
        if query_positions is None:
            return x, cos_sin, None
        mask = rect_mask(query_positions, num_keys, self.config.num_queries_per_kv, x.dtype)
        return x, cos_sin, mask

    def graph_tail(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(self.model.norm(x), rows)

    def pack_weights(self, batch_hint: int, head: bool = True, graphs: bool = False) -> None:
        """CPU steps: every GEMM reads a copy of its weight packed for oneDNN, MKL or
        the panel GEMM, whichever measures fastest here (`cpu_gemm_backend`), which
        replaces the plain weight; the embedding table stays beside the LM head's packed
        copy of it (lookups read it). `graphs`: packed as tensors a compiled region takes
        (`pack_graph_weight`), MKL's beside the panels as in eager steps."""
        gemms = self.model.layers[0].gemms()  # every stage holds at least one layer
        shapes = tuple((m.out_features // parts, m.in_features) for m, parts in gemms)
        dtype = next(self.parameters()).dtype
        backend = cpu_gemm_backend(dtype, shapes)
        layer_bytes = sum(m.weight.numel() for m, _ in gemms) * torch.finfo(dtype).bits // 8
        large_rows = prefill_gemm_rows(backend, layer_bytes * len(self.model.layers))
        for layer in self.model.layers:
            for module, parts in layer.gemms():
                module.pack(batch_hint, backend, parts, large_rows, graphs)
        if head:
            pack = pack_graph_weight if graphs else pack_weight
            self.packed_head = pack(self.head_weight(), batch_hint, backend)

    def head_weight(self) -> torch.Tensor:
        """The LM head's plain weight (the embedding's when tied)."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits `[len(rows), vocab]` for the given token rows of `hidden`."""
        weight = self.head_weight() if self.packed_head is None else self.packed_head
        return linear(hidden.index_select(0, rows), weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; all must be covered."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = self._target(name)
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            self._copy(target, params[target], tensor, shard)
            loaded.add(f"{target}#{shard}")
        self._check_complete(params, loaded)

    @staticmethod
    def _target(name: str) -> tuple[str, int | None]:
        for fragment, (fused, shard) in STACKED_PARAMS.items():
            if fragment in name:
                return name.replace(fragment, fused), shard
        return name, None

    def _copy(
        self, name: str, param: nn.Parameter, tensor: torch.Tensor, shard: int | None
    ) -> None:
        dest = param.data
        if shard is not None:
            sizes = self._shard_sizes(name)
            dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
        if dest.shape != tensor.shape:
            raise ValueError(
                f"weight for {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)

    def _shard_sizes(self, name: str) -> list[int]:
        c = self.config
        if ".gate_up_proj." in name:
            return [c.intermediate_size] * 2
        kv = c.num_key_value_heads * c.head_dim
        return [c.num_attention_heads * c.head_dim, kv, kv]

    @staticmethod
    def _check_complete(params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        expected = set()
        for name in params:
            shards = [s for fused, s in STACKED_PARAMS.values() if fused in name]
            expected |= {f"{name}#{s}" for s in shards or [None]}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights for {missing[:5]} ({len(missing)} missing)")


def paged_attend(
    k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata
) -> Attend:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, metadata)
        return paged_attention(q, k, v, k_cache, v_cache, metadata, scale)

    return attend


def graph_layer(
    layer: LlamaDecoderLayer,
    x: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    token_order: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    kernel: bool = False,
) -> torch.Tensor:
    """One decoder layer of a padded step from tensors alone: the region compiled once per
    shape and reused by every layer (the layer's weights are inputs, not constants).
    Attention: `attend_rect` under `mask`, or with `kernel` the CPU's varlen kernel as a
    custom op (`graph_ops.paged_prefill_rect`) over the rectangle's real tokens."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        write_slots(k, v, k_cache, v_cache, slots)
        if kernel:
            return paged_prefill_rect(
                q, k_cache, v_cache, block_tables, token_order, query_start_loc, context_lens,
                scale,
            )  # fmt: skip
        return attend_rect(q, k_cache, v_cache, block_tables, mask, scale)

    return layer(x, cos_sin, attend)


def graph_decode_layer(
    layer: LlamaDecoderLayer,
    x: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_list: torch.Tensor,
    block_rows: torch.Tensor,
    block_valid: torch.Tensor,
    block_starts: torch.Tensor,
    context_lens: torch.Tensor,
    kernel: bool = False,
) -> torch.Tensor:
    """`graph_layer` of a decode step over its flat block list: `attend_flat`, or with
    `kernel` the CPU kernel as a custom op (`graph_ops.paged_decode_flat`), which reads
    each row's blocks from `block_starts` and its `context_lens` instead of the masks."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        write_slots(k, v, k_cache, v_cache, slots)
        if kernel:
            return paged_decode_flat(
                q, k_cache, v_cache, block_list, block_starts, context_lens, scale
            )
        return attend_flat(q, k_cache, v_cache, block_list, block_rows, block_valid, scale)

    return layer(x, cos_sin, attend)
