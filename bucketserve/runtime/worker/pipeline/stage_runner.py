"""One pipeline stage on one device: its layers, their paged KV, and (last stage) sampling."""

from __future__ import annotations

import logging
import time

import torch

from bucketserve.runtime.core.logprobs import TokenLogprob
from bucketserve.runtime.distributed.tp_group import TPGroup
from bucketserve.runtime.io.weights import iter_safetensors
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.pipeline.stage_clock import StageClock
from bucketserve.runtime.worker.pipeline.stage_model import StageModel
from bucketserve.runtime.worker.pipeline.stage_spec import StageSpec
from bucketserve.runtime.worker.pipeline.stage_step import StageStep
from bucketserve.runtime.worker.prompt_logprobs import prompt_spans, record_prompt_logprobs
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from bucketserve.runtime.worker.step_inputs import Shape

logger = logging.getLogger(__name__)

# hidden states, or the last stage's tokens and the prompt logprobs it computed (by row)
StageOutput = torch.Tensor | tuple[list[int | None], dict[int, dict[int, TokenLogprob]]]


class StageRunner(ModelRunner):
    """A ModelRunner over one stage's slice of the model: it builds step inputs the same
    way (so the block tables of the group's one BlockManager address its pool), runs its
    layers on the previous stage's hidden states and returns its own; the last stage
    samples. Its KV pool holds its layers only, numbered from 0.

    With `tp` it is one rank of the stage's tensor-parallel group (its shard of the
    stage's layers and KV heads): rank 0 takes the previous stage's hidden states and
    broadcasts them to the others, and only rank 0 samples (`TensorParallelStage`)."""

    def __init__(
        self, config: ModelRunnerConfig, spec: StageSpec, tp: TPGroup | None = None
    ) -> None:
        self.spec = spec
        eager = config.model_copy(update={"execution": "eager"})  # no graphs across a stage yet
        super().__init__(eager, tp)
        self.clock = StageClock(spec.index)

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    def _build_model(self) -> torch.nn.Module:
        return StageModel.build(
            self.model_config,
            self.spec,
            iter_safetensors(self.model_dir),
            self.device.torch_device,
            self.dtype,
            self.max_model_len,
            self.tp,
        )

    def _compiled_graphs(self) -> tuple[None, None]:
        return None, None

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
        pad_to = self._stage_shape(step.pad_to)
        self.inputs.validate(seqs, counts, padded=pad_to is not None)
        inputs = self.inputs.build(seqs, counts, pad_to, spans or None)
        if hidden is not None:
            hidden = hidden.to(self.device.torch_device, non_blocking=True)
        if self.tp is not None and not self.spec.is_first:
            hidden = self._share_hidden(hidden, inputs.input_ids.shape[0])
        out = self.model(inputs.input_ids, hidden, inputs.positions, self.kv_cache, inputs.metadata)
        if not self.spec.is_last:
            return out
        logits = self.model.compute_logits(out, inputs.logits_rows)  # every rank: all-gather
        if self.tp is not None and self.tp.rank != 0:
            return [], {}
        prompt_logprobs: dict[int, dict[int, TokenLogprob]] = {}
        if spans:  # the head's sequences are not these (over Ray), so they travel back
            record_prompt_logprobs(seqs, spans, logits[inputs.num_seqs :])
            prompt_logprobs = {s.row: seqs[s.row].prompt_logprobs for s in spans}
        return self._sample(seqs, counts, logits[: inputs.num_seqs]), prompt_logprobs

    def _share_hidden(self, hidden: torch.Tensor | None, tokens: int) -> torch.Tensor:
        """The stage's input on every rank of its group: rank 0 got it from the previous
        stage (whose ranks all held it after their last all-reduce), the others receive
        it, `tokens` rows as each rank's own step inputs count."""
        if self.tp.rank == 0:
            x = hidden.contiguous()
        else:
            x = torch.empty(
                tokens, self.model_config.hidden_size, dtype=self.dtype,
                device=self.device.torch_device,
            )  # fmt: skip
        return self.tp.broadcast(x)

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
            inputs = self.inputs.build([], [], shape)
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

