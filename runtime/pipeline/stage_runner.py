"""One pipeline stage on one device: its layers, their paged KV, and (last stage) sampling."""

from __future__ import annotations

import logging
import time

import torch

from runtime.device import Device
from runtime.kv_cache import KVCache
from runtime.logprobs import TokenLogprob
from runtime.model_config import ModelConfig
from runtime.model_runner import ModelRunner, ModelRunnerConfig
from runtime.pipeline.stage_clock import StageClock
from runtime.pipeline.stage_model import StageModel
from runtime.pipeline.stage_spec import StageSpec
from runtime.pipeline.stage_step import StageStep
from runtime.prompt_logprobs import prompt_spans, record_prompt_logprobs
from runtime.sampler import Sampler
from runtime.sequence import Sequence
from runtime.step_inputs import InputBuilder, Shape
from runtime.tokenizer import Tokenizer
from runtime.weights import iter_safetensors, resolve_model

logger = logging.getLogger(__name__)

# hidden states, or the last stage's tokens and the prompt logprobs it computed (by row)
StageOutput = torch.Tensor | tuple[list[int | None], dict[int, dict[int, TokenLogprob]]]


class StageRunner(ModelRunner):
    """A ModelRunner over one stage's slice of the model: it builds step inputs the same
    way (so the block tables of the group's one BlockManager address its pool), runs its
    layers on the previous stage's hidden states and returns its own; the last stage
    samples. Its KV pool holds its layers only, numbered from 0."""

    def __init__(self, config: ModelRunnerConfig, spec: StageSpec) -> None:
        # Not ModelRunner.__init__: that loads every layer. The attributes are the ones
        # ModelRunner's step-input code reads.
        self.config = config
        self.spec = spec
        self.device = Device(config.device)
        self.dtype = self.device.resolve_dtype(config.dtype)
        self.model_dir = resolve_model(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.max_model_len = self._max_model_len()
        self.block_size = config.block_size
        self.model = StageModel.build(
            self.model_config,
            spec,
            iter_safetensors(self.model_dir),
            self.device.torch_device,
            self.dtype,
            self.max_model_len,
        )
        c = self.model_config
        self.kv_cache = KVCache(
            spec.num_layers,
            self._num_kv_blocks(),
            self.block_size,
            c.num_key_value_heads,
            c.head_dim,
            self.dtype,
            self.device.torch_device,
        )
        self.sampler = Sampler(config.seed, self.eos_token_ids)
        self.inputs = InputBuilder(
            self.block_size,
            self.kv_cache.num_blocks,
            self.kv_cache.null_block,
            self.max_model_len,
            self.device.torch_device,
        )
        self.execution, self.graphs = "eager", None
        self.clock = StageClock(spec.index)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        c = self.model_config
        per_block = KVCache.block_bytes(
            self.spec.num_layers, self.block_size, c.num_key_value_heads, c.head_dim, self.dtype
        )
        budget = self.device.free_memory() * self.config.kv_memory_fraction
        if self.device.type == "cpu":
            budget = min(budget, self.config.cpu_kv_cache_bytes)
        return max(1, int(budget // per_block))

    @torch.inference_mode()
    def run(self, step: StageStep, hidden: torch.Tensor | None) -> StageOutput:
        """This stage's part of `step`: hidden states for the next stage, or (last stage)
        each sequence's sampled token (None for a partial prefill chunk)."""
        start = time.time()
        try:
            return self._run_stage(step, hidden)
        finally:
            self.clock.record(step.microbatch, start, time.time())

    def _run_stage(self, step: StageStep, hidden: torch.Tensor | None) -> StageOutput:
        seqs, counts = step.seqs, step.num_new_tokens
        spans = prompt_spans(seqs, counts) if self.spec.is_last else []
        inputs = self.inputs.prepare(seqs, counts, self._stage_shape(step.pad_to), spans or None)
        if hidden is not None:
            hidden = hidden.to(self.device.torch_device, non_blocking=True)
        out = self.model(inputs.input_ids, hidden, inputs.positions, self.kv_cache, inputs.metadata)
        if not self.spec.is_last:
            return out
        logits = self.model.compute_logits(out, inputs.logits_rows)
        prompt_logprobs: dict[int, dict[int, TokenLogprob]] = {}
        if spans:  # the head's sequences are not these (over Ray), so they travel back
            record_prompt_logprobs(seqs, spans, logits[inputs.num_seqs :])
            prompt_logprobs = {s.row: seqs[s.row].prompt_logprobs for s in spans}
        return self._sample(seqs, counts, logits[: inputs.num_seqs]), prompt_logprobs

    def _sample(
        self, seqs: list[Sequence], counts: list[int], logits: torch.Tensor
    ) -> list[int | None]:
        rows = [i for i, s in enumerate(seqs) if s.num_computed_tokens + counts[i] == len(s)]
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

    def _stage_shape(self, pad_to: Shape | None) -> Shape | None:
        """Stages run eagerly (no graphs across a stage yet): prompt shapes pad to their
        rectangle; decode shapes, whose blocks are the batch's flat list, run unpadded."""
        if pad_to is None or pad_to[1] == 1:
            return None
        return self.inputs.check_shape(pad_to)

    @torch.inference_mode()
    def warmup(self, shapes) -> None:
        """Each prompt shape once on dummy rows (decode steps run unpadded)."""
        hidden_size = self.model_config.hidden_size
        for shape in shapes:
            shape = self._stage_shape(shape)
            if shape is None:
                continue
            inputs = self.inputs.prepare([], [], shape)
            hidden = None
            if not self.spec.is_first:
                tokens = inputs.input_ids.shape[0]
                hidden = torch.zeros(
                    tokens, hidden_size, dtype=self.dtype, device=self.device.torch_device
                )
            self.model(inputs.input_ids, hidden, inputs.positions, self.kv_cache, inputs.metadata)
        self.device.synchronize()

    def info(self) -> dict:
        return {
            "stage": self.spec.index,
            "layers": [self.spec.start, self.spec.stop],
            "device": str(self.device.torch_device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "num_kv_blocks": self.num_kv_blocks,
        }

    def export_blocks(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """A global layer's blocks, in the wire layout (the layer must be this stage's)."""
        return self.kv_cache.export_blocks(layer - self.spec.start, block_ids)

    def import_blocks(self, layer: int, block_ids: list[int], data: torch.Tensor) -> None:
        self.kv_cache.import_blocks(layer - self.spec.start, block_ids, data)

