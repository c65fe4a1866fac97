"""Runs scheduled steps on the model: inputs from Sequences, paged KV, sampling."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from numbers import Integral

import numpy as np
import torch

from runtime.attention import AttentionGroup, AttentionMetadata
from runtime.device import Device, GraphFn
from runtime.kv_cache import KVCache
from runtime.model_config import ModelConfig
from runtime.models import MODEL_REGISTRY
from runtime.prompt_logprobs import PromptSpan, prompt_spans, record_prompt_logprobs, span_rows
from runtime.sampler import Sampler
from runtime.sequence import Sequence
from runtime.tokenizer import Tokenizer
from runtime.weights import iter_safetensors, resolve_model

logger = logging.getLogger(__name__)

Shape = tuple[int, int, int]  # (batch, query_len, num_blocks)
LayerHook = Callable[[int], None]


@dataclass
class ModelRunnerConfig:
    """`model`: None (embedded SmolLM2), a HF directory or a .gguf file.

    The KV pool holds `num_kv_blocks` blocks if given, else
    `kv_memory_fraction` of the memory free after loading the model (on CPU
    at most `cpu_kv_cache_bytes`).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_memory_fraction: float = 0.8
    cpu_kv_cache_bytes: int = 1 << 30
    max_model_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1
        ):
            raise ValueError(f"num_kv_blocks must be None or >= 1, got {self.num_kv_blocks!r}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(
                f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction!r}"
            )
        if self.cpu_kv_cache_bytes < 1:
            raise ValueError(
                f"cpu_kv_cache_bytes must be positive, got {self.cpu_kv_cache_bytes!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be None or >= 1, got {self.max_model_len!r}")


@dataclass
class StepInputs:
    """One step's device tensors; `logits_rows` picks each row's last new token."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_rows: torch.Tensor
    metadata: AttentionMetadata
    num_seqs: int

    def padded_args(self) -> tuple[torch.Tensor, ...]:
        """`_padded_forward`'s arguments (a `pad_to` step has one group)."""
        md = self.metadata
        return (
            self.input_ids,
            self.positions,
            self.logits_rows,
            md.slot_mapping,
            md.query_start_loc,
            md.context_lens,
            md.block_tables,
            md.groups[0].query_positions,
        )


class ModelRunner:
    """Owns the model, its tokenizer and the KV pool; computes scheduled chunks.

    `execute` is the scheduler's contract: for each sequence it computes
    `token_ids[num_computed_tokens : num_computed_tokens + n]`, writes their
    K/V into the blocks of `seq.block_table`, and returns the sampled next
    token when the chunk reaches the end of the sequence (else None). It
    never mutates a Sequence's tokens or counters; it records the prompt logprobs of those
    that ask in `seq.prompt_logprobs` (such a step runs unpadded). `on_layer(i)` is
    called as soon as layer i's K/V of the step is written (while later layers still
    compute), so a prefill can ship its KV layer by layer.
    """

    def __init__(self, config: ModelRunnerConfig | None = None) -> None:
        self.config = config = config or ModelRunnerConfig()
        self.device = Device(config.device)
        self.dtype = self.device.resolve_dtype(config.dtype)
        self.model_dir = resolve_model(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.max_model_len = self._max_model_len()
        self.block_size = config.block_size
        model_cls = MODEL_REGISTRY[self.model_config.architecture]
        self.model = model_cls.build(
            self.model_config,
            iter_safetensors(self.model_dir),
            self.device.torch_device,
            self.dtype,
            self.max_model_len,
        )
        c = self.model_config
        self.kv_cache = KVCache(
            c.num_hidden_layers,
            self._num_kv_blocks(),
            self.block_size,
            c.num_key_value_heads,
            c.head_dim,
            self.dtype,
            self.device.torch_device,
        )
        self.sampler = Sampler(config.seed, self.eos_token_ids)
        self._graphs: dict[Shape, GraphFn] = {}

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def eos_token_ids(self) -> set[int]:
        """The model's end-of-sequence ids, the tokenizer's included."""
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return eos

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(
                f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}"
            )
        return wanted

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        c = self.model_config
        per_block = KVCache.block_bytes(
            c.num_hidden_layers, self.block_size, c.num_key_value_heads, c.head_dim, self.dtype
        )
        budget = self.device.free_memory() * self.config.kv_memory_fraction
        if self.device.type == "cpu":
            budget = min(budget, self.config.cpu_kv_cache_bytes)
        blocks = int(budget // per_block)
        if blocks < 1:
            raise ValueError(
                f"no memory left for a KV block ({per_block} bytes); raise kv_memory_fraction "
                "or cpu_kv_cache_bytes, or set num_kv_blocks"
            )
        if blocks * self.block_size < self.max_model_len:
            logger.warning("KV pool (%d blocks) cannot hold one max_model_len sequence", blocks)
        return blocks

    @torch.inference_mode()
    def execute(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: Shape | None = None,
        on_layer: LayerHook | None = None,
    ) -> list[int | None]:
        """Run one step; returns each sequence's sampled token, or None for a partial chunk."""
        spans = prompt_spans(seqs, num_new_tokens)
        logits = self._run(seqs, num_new_tokens, None if spans else pad_to, on_layer, spans)
        if spans:
            record_prompt_logprobs(seqs, spans, logits[len(seqs) :])
            logits = logits[: len(seqs)]
        rows = [
            i for i, s in enumerate(seqs) if s.num_computed_tokens + num_new_tokens[i] == len(s)
        ]
        out: list[int | None] = [None] * len(seqs)
        if rows:
            picked = self.sampler(
                logits if len(rows) == len(seqs) else logits[rows],
                [seqs[i].sampling_params for i in rows],
                [seqs[i].num_output_tokens for i in rows],
                [seqs[i] for i in rows],
            )
            for i, token in zip(rows, picked, strict=True):
                out[i] = token
        return out

    @torch.inference_mode()
    def compute_logits(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: Shape | None = None,
    ) -> torch.Tensor:
        """Like `execute` (K/V are written too) but returns float32 logits of each
        sequence's last new token, `[len(seqs), vocab]`, on the CPU."""
        return self._run(seqs, num_new_tokens, pad_to).cpu()

    @torch.inference_mode()
    def warmup(self, shapes: Iterable[Shape]) -> None:
        """Run every (batch, query_len, num_blocks) shape once on dummy rows, capturing
        a graph per shape where the device has graphs."""
        for shape in shapes:
            args = self._prepare([], [], self._check_shape(shape)).padded_args()
            if self.device.type == "cpu":
                self._padded_forward(*args)
            elif shape not in self._graphs:
                self._graphs[shape] = self.device.graph(self._padded_forward, args)
        self.device.synchronize()

    def _run(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: Shape | None,
        on_layer: LayerHook | None = None,
        spans: list[PromptSpan] | None = None,
    ):
        """Logits of each sequence's last new token, then those of the `spans` (unpadded)."""
        pad_to = None if pad_to is None else self._check_shape(pad_to)
        inputs = self._prepare(seqs, num_new_tokens, pad_to, spans)
        if pad_to in self._graphs:
            logits = self._graphs[pad_to](*inputs.padded_args())[: inputs.num_seqs]
            for layer in range(self.kv_cache.num_layers if on_layer else 0):
                on_layer(layer)  # a replayed graph cannot stop between layers
            return logits
        cache = self.kv_cache if on_layer is None else _LayerWatch(self.kv_cache, on_layer)
        logits = self._forward(
            inputs.input_ids, inputs.positions, inputs.logits_rows, inputs.metadata, cache
        )
        if on_layer is not None:
            on_layer(self.kv_cache.num_layers - 1)
        return logits if spans else logits[: inputs.num_seqs]

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_rows: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCache | _LayerWatch | None = None,
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, kv_cache or self.kv_cache, metadata)
        return self.model.compute_logits(hidden, logits_rows)

    def _padded_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_rows: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        query_positions: torch.Tensor,
    ) -> torch.Tensor:
        """`_forward` of a `pad_to` step from tensors only, as graph capture needs."""
        metadata = self._metadata(
            slot_mapping,
            query_start_loc,
            context_lens,
            block_tables,
            [AttentionGroup(block_tables, query_positions)],
        )
        return self._forward(input_ids, positions, logits_rows, metadata)

    def _metadata(self, slot_mapping, query_start_loc, context_lens, block_tables, groups):
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            block_tables=block_tables,
            block_size=self.block_size,
            null_block=self.kv_cache.null_block,
            groups=groups,
        )

    def _check_shape(self, shape: Sequence_[int]) -> Shape:
        ok = (
            isinstance(shape, (tuple, list))
            and len(shape) == 3
            and all(isinstance(x, Integral) and x >= 1 for x in shape)
        )
        if not ok:
            raise ValueError(
                f"shape must be (batch, query_len, num_blocks) of ints >= 1, got {shape!r}"
            )
        if shape[2] * self.block_size > self.max_model_len + self.block_size - 1:
            raise ValueError(
                f"shape {tuple(shape)} has more blocks than max_model_len {self.max_model_len}"
            )
        return (int(shape[0]), int(shape[1]), int(shape[2]))

    def _validate(self, seqs: list[Sequence], num_new_tokens: list[int]) -> None:
        if len(seqs) != len(num_new_tokens):
            raise ValueError(f"{len(seqs)} sequences but {len(num_new_tokens)} num_new_tokens")
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            if not isinstance(n, Integral) or not 1 <= n <= len(seq) - start:
                raise ValueError(
                    f"seq {seq.seq_id}: num_new_tokens {n!r} must be in [1, {len(seq) - start}]"
                )
            end = start + n
            if end > self.max_model_len:
                raise ValueError(
                    f"seq {seq.seq_id}: {end} tokens exceed max_model_len {self.max_model_len}"
                )
            needed = -(-end // self.block_size)
            table = seq.block_table[:needed]
            if len(table) < needed:
                raise ValueError(
                    f"seq {seq.seq_id}: block_table has {len(seq.block_table)} blocks, "
                    f"{needed} are needed for {end} tokens"
                )
            if any(not 0 <= b < self.num_kv_blocks for b in table):
                raise ValueError(
                    f"seq {seq.seq_id}: block ids must be in [0, {self.num_kv_blocks})"
                )

    def _prepare(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: Shape | None,
        spans: list[PromptSpan] | None = None,
    ) -> StepInputs:
        """Device tensors for a step. Tokens are flat; with `pad_to=(B, Q, NB)` they are laid
        out `[B, Q]`, padding tokens write nowhere, dummy rows fill the batch and block
        tables have NB columns, so the step has exactly that shape."""
        self._validate(seqs, num_new_tokens)
        if not seqs and pad_to is None:
            raise ValueError("execute needs at least one sequence")
        b = _Batch(seqs, num_new_tokens, self.block_size)
        rows, max_q, max_blocks = b.n, int(b.qlens.max(initial=1)), int(b.nblocks.max(initial=1))
        if pad_to is not None:
            if pad_to[0] < rows or pad_to[1] < max_q or pad_to[2] < max_blocks:
                raise ValueError(
                    f"pad_to {pad_to} is smaller than the step (batch {rows}, "
                    f"query_len {max_q}, num_blocks {max_blocks})"
                )
            rows, max_q, max_blocks = pad_to
        # Prompt chunks with no earlier context attend to themselves alone (not in a graph).
        fresh = (b.starts == 0) & (b.qlens > 1) & (pad_to is None)
        rectangular = pad_to is not None or bool((b.qlens == max_q).all() and not fresh.any())
        qlens = np.zeros(rows, dtype=np.int64)
        qlens[: b.n] = b.qlens
        row_start = np.arange(rows) * max_q if rectangular else np.cumsum(qlens) - qlens
        num_tokens = rows * max_q if rectangular else int(b.qlens.sum())
        flat = row_start[b.seq_idx] + b.within

        tables = np.full((rows, max_blocks), self.kv_cache.null_block, dtype=np.int64)
        for i, seq in enumerate(seqs):
            tables[i, : b.nblocks[i]] = seq.block_table[: b.nblocks[i]]
        input_ids = np.zeros(num_tokens, dtype=np.int64)
        input_ids[flat] = b.token_ids()
        positions = np.zeros(num_tokens, dtype=np.int64)
        positions[flat] = b.pos
        slots = np.full(num_tokens, -1, dtype=np.int64)
        slots[flat] = tables[b.seq_idx, b.pos // self.block_size] * self.block_size
        slots[flat] += b.pos % self.block_size
        context_lens = np.zeros(rows, dtype=np.int32)
        context_lens[: b.n] = b.starts + b.qlens
        query_start_loc = np.append(row_start, num_tokens).astype(np.int32)
        logits_rows = row_start + np.maximum(qlens - 1, 0)
        if spans:
            logits_rows = np.concatenate([logits_rows, span_rows(spans, row_start)])

        t = self._to_device
        if rectangular:
            qpos = np.zeros((rows, max_q), dtype=np.int64)
            qpos[b.seq_idx, b.within] = b.pos
            groups = [AttentionGroup(t(tables), t(qpos))]
        else:
            groups = [
                self._group(b, rows_in, tables, row_start, flat)
                for rows_in in _split_rows(b.qlens, ~fresh)
            ]
        metadata = self._metadata(t(slots), t(query_start_loc), t(context_lens), t(tables), groups)
        metadata.causal_spans = [
            (int(row_start[i]), int(row_start[i] + b.qlens[i])) for i in np.flatnonzero(fresh)
        ]
        return StepInputs(t(input_ids), t(positions), t(logits_rows), metadata, b.n)

    def _group(
        self,
        b: _Batch,
        rows: np.ndarray,
        tables: np.ndarray,
        row_start: np.ndarray,
        flat: np.ndarray,
    ) -> AttentionGroup:
        """An AttentionGroup for some rows of a flat (non-rectangular) step."""
        qlens = b.qlens[rows]
        max_q, max_blocks = int(qlens.max()), int(b.nblocks[rows].max())
        local = np.full(b.n, -1, dtype=np.int64)
        local[rows] = np.arange(len(rows))
        mine = local[b.seq_idx] >= 0
        slot = local[b.seq_idx[mine]] * max_q + b.within[mine]
        qpos = np.zeros(len(rows) * max_q, dtype=np.int64)
        qpos[slot] = b.pos[mine]
        last = np.maximum(qlens - 1, 0)[:, None]
        gather = row_start[rows][:, None] + np.minimum(np.arange(max_q), last)
        t = self._to_device
        full = bool((qlens == max_q).all())
        return AttentionGroup(
            block_tables=t(tables[rows, :max_blocks]),
            query_positions=t(qpos.reshape(len(rows), max_q)),
            gather_index=t(gather.reshape(-1)),
            valid_slots=None if full else t(slot),
            tokens=t(gather.reshape(-1) if full else flat[mine]),
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device.torch_device)


class _LayerWatch:
    """The KV pool as the model sees it during one forward: the model asks for layer i + 1
    only once layer i's K/V is written, so that is when layer i is reported done."""

    def __init__(self, cache: KVCache, on_layer: LayerHook) -> None:
        self.cache = cache
        self.on_layer = on_layer

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer > 0:
            self.on_layer(layer - 1)
        return self.cache.layer(layer)


class _Batch:
    """Per-token bookkeeping of a step's real sequences (numpy, host side)."""

    def __init__(self, seqs: list[Sequence], num_new_tokens: list[int], block_size: int) -> None:
        self.seqs = seqs
        self.n = len(seqs)
        self.qlens = np.asarray(num_new_tokens, dtype=np.int64)
        self.starts = np.asarray([s.num_computed_tokens for s in seqs], dtype=np.int64)
        self.nblocks = -(-(self.starts + self.qlens) // block_size)
        self.seq_idx = np.repeat(np.arange(self.n), self.qlens)
        self.within = np.arange(len(self.seq_idx)) - np.repeat(
            np.cumsum(self.qlens) - self.qlens, self.qlens
        )
        self.pos = self.starts[self.seq_idx] + self.within

    def token_ids(self) -> np.ndarray:
        chunks = (
            s.token_ids[a : a + q]
            for s, a, q in zip(self.seqs, self.starts.tolist(), self.qlens.tolist(), strict=True)
        )
        return np.fromiter(
            itertools.chain.from_iterable(chunks), dtype=np.int64, count=len(self.pos)
        )


def _split_rows(qlens: np.ndarray, paged: np.ndarray) -> list[np.ndarray]:
    """The `paged` rows in groups: decode rows (one new token) apart from prefill rows, so
    neither pads to the other."""
    decode = qlens == 1
    groups = (np.flatnonzero(paged & decode), np.flatnonzero(paged & ~decode))
    return [rows for rows in groups if len(rows)]
