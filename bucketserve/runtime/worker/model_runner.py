"""Runs scheduled steps on the model: inputs from Sequences, paged KV, sampling."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.cpu.block_gemm import runs_blocks
from bucketserve.runtime.distributed.tp_group import TPGroup
from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.io.tokenizer import Tokenizer
from bucketserve.runtime.io.weights import iter_safetensors
from bucketserve.runtime.layers.packing import describe_weights, pack_weights
from bucketserve.runtime.loader.model_files import resolve_model
from bucketserve.runtime.models import load_model_config, model_class
from bucketserve.runtime.worker.compiled_graphs import CompiledGraphs, GraphStats
from bucketserve.runtime.worker.device import Device
from bucketserve.runtime.worker.kv_cache import KVCache
from bucketserve.runtime.worker.prompt_logprobs import (
    PromptSpan,
    prompt_spans,
    record_prompt_logprobs,
)
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from bucketserve.runtime.worker.sampler import Sampler
from bucketserve.runtime.worker.step_inputs import InputBuilder, Shape, StepInputs, UnifiedShape
from bucketserve.runtime.worker.structured_output import GrammarMask, StructuredOutputManager

logger = logging.getLogger(__name__)

LayerHook = Callable[[int], None]


# The GEMM row count packed weights are laid out for: a decode batch. Any row count
# runs on them; prefill chunks (hundreds of rows) lose nothing measurable.
_PACK_BATCH_HINT = 64


class ModelRunner:
    """Owns the model, its tokenizer and the KV pool; computes scheduled chunks.

    `execute` is the scheduler's contract: for each sequence it computes
    `token_ids[num_computed_tokens : num_computed_tokens + n]`, writes their
    K/V into the blocks of `seq.block_table`, and returns the sampled next
    token when the chunk reaches the end of the sequence (else None). It
    never mutates a Sequence's tokens or counters; it records the prompt logprobs of those
    that ask in `seq.prompt_logprobs` (such a step runs unpadded and eager). `on_layer(i)`
    is called as soon as layer i's K/V of the step is written (while later layers still
    compute), so a prefill can ship its KV layer by layer.

    With `tp`, this runner is one rank of a tensor-parallel group: its model and KV pool
    hold the rank's shard (`model.num_kv_heads` heads), every rank runs `step_logits` on
    the same step, and only the head rank samples.
    """

    def __init__(self, config: ModelRunnerConfig | None = None, tp: TPGroup | None = None) -> None:
        self.config = config = config or ModelRunnerConfig()
        self.tp = tp
        self.device = Device(config.device)
        self.dtype = self.device.resolve_dtype(config.dtype)
        self.execution = resolve_execution(config.execution, self.device.type)
        self.model_dir = resolve_model(config.model, keep_blocks=self._keeps_blocks())
        self.model_config = load_model_config(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir, config.chat_template)
        self.max_model_len = self._max_model_len()
        self.block_size = config.block_size
        self.model = self._build_model()
        self.weight_formats, self.weight_bytes = describe_weights(self.model)
        logger.info("weights: %s; %.0f MiB", self.weight_formats, self.weight_bytes / 2**20)
        c = self.model_config
        self.kv_cache = KVCache(
            self.num_layers,
            self._num_kv_blocks(),
            self.block_size,
            self.model.num_kv_heads,
            c.head_dim,
            self.dtype,
            self.device.torch_device,
        )
        self.sampler = Sampler(config.seed, self.eos_token_ids)
        self.structured = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
        )
        self.inputs = InputBuilder(
            self.block_size,
            self.kv_cache.num_blocks,
            self.kv_cache.null_block,
            self.max_model_len,
            self.device.torch_device,
        )
        if self.execution == "eager":
            pack_weights(self.model, _PACK_BATCH_HINT)
        elif self.device.type == "cpu":  # graphs: the CPU's compiled regions call its GEMMs
            pack_weights(self.model, _PACK_BATCH_HINT, graphs=True)
        self.graphs, self._flat = self._compiled_graphs()

    def _keeps_blocks(self) -> bool:
        """Whether a GGUF's quantized weights stay in their blocks (`quantization`)."""
        if self.config.quantization == "none":
            return False
        why = None
        if self.device.type != "cpu" or self.dtype != torch.float32:
            why = f"{self.dtype} on {self.device.type}"
        elif self.tp is not None:
            why = "tensor parallelism"
        elif self.execution != "eager":
            why = f"execution {self.execution}"
        elif not runs_blocks():
            why = "no CPU kernel library"
        if why is not None:
            logger.info("quantization auto: %s runs no quantized blocks; weights in float", why)
        return why is None

    @property
    def num_layers(self) -> int:
        """Layers whose K/V this runner's pool holds."""
        return self.model_config.num_hidden_layers

    def _build_model(self) -> torch.nn.Module:
        model_cls = model_class(self.model_config.architecture)
        return model_cls.build(
            self.model_config,
            iter_safetensors(self.model_dir),
            self.device.torch_device,
            self.dtype,
            self.max_model_len,
            tp=self.tp,
        )

    def _compiled_graphs(self) -> tuple[CompiledGraphs | None, CompiledGraphs | None]:
        """Graphs mode's compiled steps, and the uncompiled path eager steps padded to a
        decode shape take (they read the batch's flat block list)."""
        graphs = None
        if self.execution == "graphs":
            graphs = CompiledGraphs(self.model, self.kv_cache, self.device)
        return graphs, CompiledGraphs(self.model, self.kv_cache, self.device, compiled=False)

    @property
    def graph_stats(self) -> GraphStats | None:
        return None if self.graphs is None else self.graphs.stats

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def eos_token_ids(self) -> set[int]:
        return eos_token_ids(self.model_config, self.tokenizer)

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
            self.num_layers, self.block_size, self.model.num_kv_heads, c.head_dim, self.dtype
        )
        budget = self.device.free_memory() * self.config.kv_memory_fraction
        if self.device.type == "cpu":
            budget = min(budget, self.config.cpu_kv_cache_bytes)
        blocks = int(budget // per_block)
        if self.tp is not None:  # one block manager hands out ids for every rank's pool
            blocks = self.tp.min_int(blocks)
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
        pad_to: Shape | UnifiedShape | None = None,
        on_layer: LayerHook | None = None,
    ) -> list[int | None]:
        """Run one step; returns each sequence's sampled token, or None for a partial chunk.
        The step is validated here, once, before any path groups or pads its rows."""
        self.inputs.validate(seqs, num_new_tokens, padded=pad_to is not None)
        rows = _sampled_rows(seqs, num_new_tokens)
        masks = self.structured.begin([seqs[i] for i in rows])  # while the model runs
        logits = self.step_logits(seqs, num_new_tokens, pad_to, on_layer)
        return self._sample(seqs, num_new_tokens, logits, self.structured.finish(masks))

    @torch.inference_mode()
    def step_logits(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: Shape | UnifiedShape | None = None,
        on_layer: LayerHook | None = None,
    ) -> torch.Tensor:
        """A validated step's forward: the logits of each sequence's last new token (and
        the prompt logprobs of those that ask, recorded). Every rank of a tensor-parallel
        group runs it on the same step."""
        spans = prompt_spans(seqs, num_new_tokens)
        if not spans:
            return self._run(seqs, num_new_tokens, pad_to, on_layer)
        logits = self._run_eager(seqs, num_new_tokens, None, on_layer, spans)
        record_prompt_logprobs(seqs, spans, logits[len(seqs) :])
        return logits[: len(seqs)]

    def _sample(
        self,
        seqs: list[Sequence],
        counts: list[int],
        logits: torch.Tensor,
        mask: GrammarMask | None = None,
    ) -> list[int | None]:
        """The next token of each sequence whose chunk reaches its end (else None); `mask`
        (the grammars of those rows) is computed here when not given."""
        rows = _sampled_rows(seqs, counts)
        out: list[int | None] = [None] * len(seqs)
        if rows:
            if mask is None:
                mask = self.structured.mask([seqs[i] for i in rows])
            picked = self.sampler(
                logits if len(rows) == len(seqs) else logits[rows],
                [seqs[i].sampling_params for i in rows],
                [seqs[i].num_output_tokens for i in rows],
                [seqs[i] for i in rows],
                mask,
            )
            for i, token in zip(rows, picked, strict=True):
                out[i] = token
        return out

    @torch.inference_mode()
    def compute_logits(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: Shape | UnifiedShape | None = None,
    ) -> torch.Tensor:
        """Like `execute` (K/V are written too) but returns float32 logits of each
        sequence's last new token, `[len(seqs), vocab]`, on the CPU."""
        return self._run(seqs, num_new_tokens, pad_to).cpu()

    @torch.inference_mode()
    def warmup(
        self, shapes: Iterable[Shape | UnifiedShape]
    ) -> dict[Shape | UnifiedShape, float]:
        """Run every (batch, query_len, num_blocks) or unified (tokens, shared blocks,
        unique blocks, is_causal) shape once on dummy rows; in graphs mode that compiles
        its graph. Returns the seconds each took."""
        seconds = {}
        for shape in shapes:
            shape = self.inputs.check_shape(shape)
            inputs = self._prepare([], [], shape)
            if self.graphs is not None:
                seconds[shape] = self.graphs.warm(shape, inputs.graph_args())
                continue
            start = time.perf_counter()
            if inputs.flat is not None:  # a flat decode or a unified step
                self._flat.run(shape, inputs.flat)
            else:
                self._forward(inputs)
            seconds[shape] = time.perf_counter() - start
        self.device.synchronize()
        return seconds

    def _run(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: Shape | UnifiedShape | None,
        on_layer: LayerHook | None = None,
    ) -> torch.Tensor:
        pad_to = None if pad_to is None else self.inputs.check_shape(pad_to)
        if self.graphs is not None:
            return self._run_graphs(seqs, num_new_tokens, pad_to, on_layer)
        if pad_to is not None and len(pad_to) == 4:
            return self._run_unified(self._flat, seqs, num_new_tokens, pad_to, on_layer)
        if pad_to is not None and pad_to[1] == 1:
            flat = self._prepare(seqs, num_new_tokens, pad_to)
            return self._flat.run(pad_to, flat.graph_args(), on_layer)[: len(seqs)]
        return self._run_eager(seqs, num_new_tokens, pad_to, on_layer)[: len(seqs)]

    def _run_eager(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: Shape | None,
        on_layer: LayerHook | None = None,
        spans: list[PromptSpan] | None = None,
    ) -> torch.Tensor:
        """Logits of each sequence's last new token, then those of the `spans`."""
        inputs = self.inputs.build(seqs, num_new_tokens, pad_to, spans)
        logits = self._forward(inputs, on_layer)
        if on_layer is not None:
            on_layer(self.kv_cache.num_layers - 1)
        return logits

    def _forward(self, inputs: StepInputs, on_layer: LayerHook | None = None) -> torch.Tensor:
        cache = self.kv_cache if on_layer is None else _LayerWatch(self.kv_cache, on_layer)
        hidden = self.model(inputs.input_ids, inputs.positions, cache, inputs.metadata)
        return self.model.compute_logits(hidden, inputs.logits_rows)

    def _run_graphs(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: Shape | UnifiedShape | None,
        on_layer: LayerHook | None,
    ) -> torch.Tensor:
        """Every step padded to a shape: `pad_to`, else the smallest warmed one: the whole
        step as one unified shape once those are warmed, else decode rows apart from
        prefill rows; a part no warmed shape fits compiles its own (a miss)."""
        assert self.graphs is not None
        if pad_to is None and self.graphs.unified:
            need = self.inputs.unified_need(seqs, num_new_tokens)
            pad_to = self.graphs.fit(need) or self._miss_shape(need)
        if pad_to is not None and len(pad_to) == 4:
            return self._run_unified(self.graphs, seqs, num_new_tokens, pad_to, on_layer)
        if pad_to is not None:
            parts = [(np.arange(len(seqs)), pad_to)]
        else:
            counts = np.asarray(num_new_tokens)
            parts = []
            # decode rows together; prefill rows grouped by query length (a power of two),
            # so a short prompt never pads to a long chunk
            levels = np.where(counts == 1, 0, np.ceil(np.log2(np.maximum(counts, 2))))
            for level in np.unique(levels):
                rows = np.flatnonzero(levels == level)
                if len(rows):
                    need = self.inputs.need([seqs[i] for i in rows], counts[rows].tolist())
                    parts.append((rows, self.graphs.fit(need) or self._miss_shape(need)))
        hook = on_layer if len(parts) == 1 else None
        logits = None
        stats = self.graphs.stats
        for rows, shape in parts:
            if shape[1] > 1:
                stats.prompt_tokens += sum(num_new_tokens[i] for i in rows)
                stats.prompt_padded_tokens += shape[0] * shape[1]
            part = self._prepare(
                [seqs[i] for i in rows], [num_new_tokens[i] for i in rows], shape
            )
            out = self.graphs.run(shape, part.graph_args(), hook)[: len(rows)]
            if len(parts) == 1:
                return out
            if logits is None:
                logits = out.new_empty((len(seqs), out.shape[1]))
            logits[torch.from_numpy(rows)] = out
        for layer in range(self.kv_cache.num_layers if on_layer else 0):
            on_layer(layer)
        return logits

    def _run_unified(
        self,
        graphs: CompiledGraphs,
        seqs: list[Sequence],
        counts: list[int],
        shape: UnifiedShape,
        on_layer: LayerHook | None,
    ) -> torch.Tensor:
        """One unified step (compiled, or the same regions eager): its hidden states, then
        the LM head of each row's last token."""
        inputs = self.inputs.build_unified(seqs, counts, shape)
        prompt = [n for n in counts if n > 1]
        if graphs.compiled and prompt:  # the step's tokens, padding included, less decode rows
            graphs.stats.prompt_tokens += sum(prompt)
            graphs.stats.prompt_padded_tokens += shape[0] - (len(counts) - len(prompt))
        hidden = graphs.run(shape, inputs.graph_args(), on_layer)
        return self.model.compute_logits(hidden, inputs.logits_rows)

    def _prepare(
        self, seqs: list[Sequence], counts: list[int], shape: Shape | UnifiedShape
    ) -> StepInputs:
        """A padded step's inputs: decode shapes `(batch, 1, blocks)` as a flat block list,
        unified shapes as flat tokens with their context blocks."""
        if len(shape) == 4:
            return self.inputs.build_unified(seqs, counts, shape)
        if shape[1] == 1:
            return self.inputs.build_flat(seqs, counts, shape)
        return self.inputs.build(seqs, counts, shape)

    def _miss_shape(self, need: Shape | UnifiedShape) -> Shape | UnifiedShape:
        """The shape a step no warmed graph holds compiles: each dimension rounded up to a
        power of two (the blocks capped at max_model_len's; unified: none left at 0), so
        misses stay few."""
        if len(need) == 4:
            t, s, u = (0 if x == 0 else 1 << (x - 1).bit_length() for x in need[:3])
            return (t, s, u, need[3])
        cap = -(-self.max_model_len // self.block_size) * (need[0] if need[1] == 1 else 1)
        b, q, nb = (1 << (x - 1).bit_length() for x in need)
        return (b, q, max(min(nb, cap), need[2]))


def _sampled_rows(seqs: list[Sequence], counts: list[int]) -> list[int]:
    """The sequences whose chunk reaches their end: they sample a token this step."""
    return [i for i, s in enumerate(seqs) if s.num_computed_tokens + counts[i] == len(s)]


def eos_token_ids(model_config: ModelConfig, tokenizer: Tokenizer) -> set[int]:
    """The model's end-of-sequence ids, the tokenizer's included."""
    eos = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return eos


def resolve_execution(setting: str, device_type: str) -> str:
    """`auto`: graphs where a graph compiler pays (hpu, cuda), eager on cpu."""
    if setting == "auto":
        return "eager" if device_type == "cpu" else "graphs"
    return setting


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


