"""Roofline step times: each forward step is its dense GEMMs plus its attention, each bound by
either compute or memory, plus a fixed per-step overhead.

    dense     = max(2 P T (T + m_half) / T / (peak x eff),  weight bytes / (bw x eff))
    attention = max(4 L H d pairs / (peak x attn_eff),  traffic x KV bytes / (bw x eff))
    allreduce = 2 L (T x hidden x bytes) 2 (tp - 1) / tp / link bandwidth   (tensor parallel)
    step      = overhead + dense + attention + allreduce

With tensor parallelism over `tp` accelerators each holds 1/tp of the weights, the heads
and the K/V, and computes 1/tp of every GEMM; two all-reduces per layer join the shards.
With `pp` pipeline stages each stage (of `tp` accelerators) holds a contiguous ceil(L/pp)
of the layers and their K/V; `time` is then one stage's step (the last, which also runs
the LM head), and a microbatch takes `pipeline_latency`: pp stage steps plus pp - 1 hops
of its hidden states over `pp_link`. A stage takes the next microbatch as soon as it hands
this one on, so pp disjoint microbatches keep every stage busy.
P: matmul weights per token (the LM head only for rows that sample), T: tokens
computed, pairs: query x key scores, KV bytes: the keys and values read and written,
traffic: passes over them (more once a layer's K/V outgrows the CPU cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.simulator.hardware import HardwareSpec, LinkSpec
from benchmarks.simulator.model_spec import ModelSpec

ACTIVATION_RESERVE_BYTES = 1e9  # activations and workspace kept out of the KV pool (assumed)


@dataclass(frozen=True)
class StepWork:
    """What one forward step computes: `rows` sequences, `tokens` new tokens in all,
    `attn_pairs` query-key scores, `kv_tokens` tokens of K/V read or written."""

    rows: int
    tokens: int
    logits_rows: int
    attn_pairs: float
    kv_tokens: float


class CostModel:
    def __init__(
        self,
        model: ModelSpec,
        hardware: HardwareSpec,
        tp: int = 1,
        tp_link: LinkSpec | None = None,
        pp: int = 1,
        pp_link: LinkSpec | None = None,
    ) -> None:
        for name, value in (("tp", tp), ("pp", pp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if tp > 1 and tp_link is None:
            raise ValueError("tensor parallelism (tp > 1) needs the tp_link its all-reduces use")
        if pp > 1 and pp_link is None:
            raise ValueError("pipeline stages (pp > 1) need the pp_link hidden states cross")
        if model.num_kv_heads % tp:
            raise ValueError(f"tp {tp} must divide {model.name}'s {model.num_kv_heads} KV heads")
        if pp > model.num_layers:
            raise ValueError(f"pp {pp} exceeds {model.name}'s {model.num_layers} layers")
        self.model = model
        self.hardware = hardware
        self.tp = tp
        self.tp_link = tp_link
        self.pp = pp
        self.pp_link = pp_link
        self.stage_layers = -(-model.num_layers // pp)  # the largest stage's share
        hw = hardware
        self._flops = hw.peak_flops * hw.flops_efficiency * tp
        self._attn_flops = hw.peak_flops * hw.attn_flops_efficiency * tp
        self._bw = hw.mem_bandwidth * hw.bw_efficiency * tp
        self._layer_flops = 2 * self.stage_layers * model.layer_params  # per token
        self._head_flops = 2 * model.lm_head_params  # per sampling row
        self._score_flops = 4 * self.stage_layers * model.num_heads * model.head_dim  # per pair
        self._stage_share = self.stage_layers / model.num_layers  # of weights and K/V

    # -- memory ------------------------------------------------------------------------------

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV that fit beside the weights in the engine's share of memory."""
        hw, m = self.hardware, self.model
        shard = m.weight_bytes * self._stage_share / self.tp
        free = hw.mem_bytes * hw.mem_utilization - shard - ACTIVATION_RESERVE_BYTES
        kv_per_token = m.kv_bytes_per_token * self._stage_share  # one stage's layers
        if free * self.tp < kv_per_token:
            raise ValueError(
                f"{m.name} ({shard / 1e9:.1f} GB of weights per accelerator at tp {self.tp}, "
                f"pp {self.pp}) leaves no KV memory on {hw.name} ({hw.mem_bytes / 1e9:.0f} "
                "GB); pick a larger accelerator or a higher tp or pp"
            )
        return int(free * self.tp // kv_per_token)

    def num_kv_blocks(self, block_size: int) -> int:
        return self.kv_capacity_tokens() // block_size

    def kv_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.model.kv_bytes_per_token

    # -- step work ---------------------------------------------------------------------------

    def work(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> StepWork:
        """Row i computes `query_lens[i]` new tokens on top of `context_lens[i]` cached ones."""
        if len(query_lens) != len(context_lens) or not query_lens:
            raise ValueError(
                f"need one context length per row and at least one row; got "
                f"{len(query_lens)} query and {len(context_lens)} context lengths"
            )
        dense = self.hardware.dense_attention
        pairs = 0.0
        for q, c in zip(query_lens, context_lens, strict=True):
            if q < 1 or c < 0:
                raise ValueError(f"query length must be >= 1 and context >= 0, got {q}, {c}")
            pairs += q * (c + q) if dense else q * c + q * (q + 1) / 2
        tokens = sum(query_lens)
        return StepWork(len(query_lens), tokens, len(query_lens), pairs, sum(context_lens) + tokens)

    def decode_work(self, num_rows: int, total_context: int) -> StepWork:
        """One new token for each of `num_rows` rows holding `total_context` cached tokens."""
        kv = total_context + num_rows
        return StepWork(num_rows, num_rows, num_rows, float(kv), float(kv))

    # -- times -------------------------------------------------------------------------------

    def time(self, work: StepWork) -> float:
        return sum(self.breakdown(work).values())

    def breakdown(self, work: StepWork) -> dict[str, float]:
        hw, m = self.hardware, self.model
        ramp = (work.tokens + hw.gemm_m_half) / work.tokens
        flops = self._layer_flops * work.tokens + self._head_flops * work.logits_rows
        kv_bytes = work.kv_tokens * m.kv_bytes_per_token * self._stage_share
        spills = kv_bytes / self.stage_layers / self.tp > hw.cache_bytes
        kv_bytes *= hw.kv_spill_traffic if spills else hw.kv_traffic
        weight_bytes = m.weight_bytes * self._stage_share
        return {
            "overhead": hw.step_overhead_s,
            "dense": max(flops * ramp / self._flops, weight_bytes / self._bw),
            "attention": max(
                work.attn_pairs * self._score_flops / self._attn_flops, kv_bytes / self._bw
            ),
            "allreduce": self._allreduce_time(work.tokens),
        }

    def _allreduce_time(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        m, link = self.model, self.tp_link
        volume = tokens * m.hidden * m.bytes_per_param * 2 * (self.tp - 1) / self.tp
        return 2 * self.stage_layers * link.transfer_time(volume)

    def hop_time(self, tokens: int) -> float:
        """One stage handing `tokens` rows of hidden states to the next."""
        if self.pp == 1:
            return 0.0
        assert self.pp_link is not None
        return self.pp_link.transfer_time(tokens * self.model.hidden * self.model.bytes_per_param)

    def pipeline_latency(self, work: StepWork) -> float:
        """A microbatch from the first stage's start to the last stage's sampled tokens."""
        return self.pp * self.time(work) + (self.pp - 1) * self.hop_time(work.tokens)

    def step_time(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        return self.time(self.work(query_lens, context_lens))

    def prefill_work(
        self,
        prompt_lens: Sequence[int],
        pad_to: tuple[int, ...] | None = None,
        context_lens: Sequence[int] | None = None,
    ) -> StepWork:
        """A prefill batch computing `prompt_lens` tokens per row on top of `context_lens`
        cached ones (default none), run varlen (`pad_to=None`) or padded to (rows, query
        length) or (rows, query length, context tokens): every row of a padded shape
        computes the whole query over the whole context."""
        if pad_to is None:
            contexts = [0] * len(prompt_lens) if context_lens is None else list(context_lens)
            return self.work(prompt_lens, contexts)
        rows, length, *rest = pad_to
        context = rest[0] if rest else 0
        if rows < len(prompt_lens) or length < max(prompt_lens):
            raise ValueError(
                f"pad_to {pad_to} cannot hold {len(prompt_lens)} prompts of up to "
                f"{max(prompt_lens)} tokens"
            )
        return self.work([length] * rows, [context] * rows)

    def prefill_time(
        self,
        prompt_lens: Sequence[int],
        pad_to: tuple[int, ...] | None = None,
        context_lens: Sequence[int] | None = None,
    ) -> float:
        return self.time(self.prefill_work(prompt_lens, pad_to, context_lens))

    def decode_time(self, num_rows: int, total_context: int) -> float:
        return self.time(self.decode_work(num_rows, total_context))

    def transfer_time(self, num_tokens: int, link: LinkSpec) -> float:
        return link.transfer_time(self.kv_bytes(num_tokens))
