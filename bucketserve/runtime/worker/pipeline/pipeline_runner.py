"""A model runner whose layers are spread over a group of pipeline stages."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.io.tokenizer import Tokenizer
from bucketserve.runtime.loader.model_files import resolve_model
from bucketserve.runtime.models import load_model_config
from bucketserve.runtime.worker.model_runner import (
    LayerHook,
    Shape,
    eos_token_ids,
)
from bucketserve.runtime.worker.pipeline.local_stage import LocalStage
from bucketserve.runtime.worker.pipeline.pipeline_stats import PipelineStats, handoff_seconds
from bucketserve.runtime.worker.pipeline.stage import Stage
from bucketserve.runtime.worker.pipeline.stage_kv_cache import StageKVCache
from bucketserve.runtime.worker.pipeline.stage_runner import StageRunner
from bucketserve.runtime.worker.pipeline.stage_spec import StageSpec, split_layers
from bucketserve.runtime.worker.pipeline.stage_step import StageStep
from bucketserve.runtime.worker.pipeline.tp_stage import TensorParallelStageRunner
from bucketserve.runtime.worker.prompt_logprobs import prompt_spans
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

StageFactory = Callable[[ModelRunnerConfig, StageSpec], Stage]


@dataclass
class Microbatch:
    """A submitted microbatch: one handle per stage, the last one's output is its tokens."""

    step: StageStep
    handles: list[Any]


class StageDevice:
    """The first stage's device as the head names it (the head itself holds no tensors)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.type = name.split(":")[0]
        self.torch_device = torch.device(name)

    def __str__(self) -> str:
        return f"Device({self.name})"  # as bucketserve.runtime.worker.device.Device prints

    def synchronize(self) -> None:
        pass


class PipelineRunner:
    """The head of a stage group: what the engine and the workers use of a ModelRunner
    (tokenizer, limits, KV format, `execute`, `warmup`), with the layers on `stages`.

    `submit` sends a microbatch down the pipeline and returns at once: every stage gets
    the step, stage s + 1 takes stage s's hidden states straight from it, so up to
    `num_stages` microbatches compute at once, each on a different stage. `result` waits
    for the last stage's tokens. The head holds no weights and no KV.
    """

    def __init__(self, config: ModelRunnerConfig, num_stages: int, make_stage: StageFactory):
        self.config = config
        self.model_dir = resolve_model(config.model, keep_blocks=config.quantization == "auto")
        self.model_config = c = load_model_config(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir, config.chat_template)
        self.max_model_len = config.max_model_len or c.max_position_embeddings
        if self.max_model_len > c.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {c.max_position_embeddings}"
            )
        self.block_size = config.block_size
        self.specs = split_layers(c.num_hidden_layers, num_stages)
        self.stages: list[Stage] = []
        try:
            for spec in self.specs:
                self.stages.append(make_stage(config, spec))
            self.stage_infos = [s.info() for s in self.stages]
        except BaseException:
            self.shutdown()
            raise
        self.device = StageDevice(self.stage_infos[0]["device"])
        self.kv_cache = StageKVCache(
            self.stages,
            min(info["num_kv_blocks"] for info in self.stage_infos),
            self.block_size,
            c.num_key_value_heads,
            c.head_dim,
            self.stage_infos[0]["dtype"],
        )
        # stages run eagerly: no graphs across a stage yet (ModelRunner's graph interface)
        self.execution, self.graphs, self.graph_stats = "eager", None, None
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._in_flight = 0
        self.peak_in_flight = 0
        self._microbatches = 0
        self._active_s = 0.0
        self._active_since = 0.0

    @classmethod
    def local(
        cls,
        config: ModelRunnerConfig,
        num_stages: int,
        torch_threads: int | None = None,
        tensor_parallel_size: int = 1,
    ) -> PipelineRunner:
        """Stages on threads of this process, `torch_threads` intra-op threads each. With
        `tensor_parallel_size` > 1 each stage is a tensor-parallel group: its head on the
        stage's thread, its other ranks spawned processes (`torch_threads` each, else this
        machine's cores shared out over every rank of every stage)."""
        if tensor_parallel_size == 1:
            return cls(
                config, num_stages,
                lambda cfg, spec: LocalStage(StageRunner(cfg, spec), torch_threads),
            )  # fmt: skip
        threads = torch_threads or max(
            1, (os.cpu_count() or 1) // (num_stages * tensor_parallel_size)
        )

        def make(cfg: ModelRunnerConfig, spec: StageSpec) -> LocalStage:
            runner = TensorParallelStageRunner(cfg, spec, tensor_parallel_size, threads)
            return LocalStage(runner, threads)

        return cls(config, num_stages, make)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def rank_pids(self) -> list[int]:
        """The processes of the stages' other tensor-parallel ranks (none without)."""
        return [pid for info in self.stage_infos for pid in info.get("rank_pids", [])]

    @property
    def eos_token_ids(self) -> set[int]:
        return eos_token_ids(self.model_config, self.tokenizer)

    # -- steps -------------------------------------------------------------------------------

    def submit(
        self, seqs: list[Sequence], num_new_tokens: list[int], pad_to: Shape | None = None
    ) -> Microbatch:
        if prompt_spans(seqs, num_new_tokens):
            pad_to = None  # the extra logits rows of prompt logprobs run unpadded, as in one stage
        step = StageStep(next(self._ids), list(seqs), list(num_new_tokens), pad_to)
        with self._lock:
            if self._in_flight == 0:
                self._active_since = time.time()
            self._in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
        handles, prev = [], None
        for stage in self.stages:
            prev = stage.submit(step, prev)
            handles.append(prev)
        return Microbatch(step, handles)

    def wait_stage(self, microbatch: Microbatch, stage: int) -> None:
        """Until `stage` is done with the microbatch (its layers' K/V written)."""
        self.stages[stage].wait(microbatch.handles[stage])

    def result(self, microbatch: Microbatch) -> list[int | None]:
        try:
            tokens, prompt_logprobs = self.stages[-1].result(microbatch.handles[-1])
            for row, logprobs in prompt_logprobs.items():
                microbatch.step.seqs[row].prompt_logprobs.update(logprobs)
            return tokens
        finally:
            with self._lock:
                self._in_flight -= 1
                self._microbatches += 1
                if self._in_flight == 0:
                    self._active_s += time.time() - self._active_since

    def execute(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: Shape | None = None,
        on_layer: LayerHook | None = None,
        on_submit: Callable[[], None] | None = None,
    ) -> list[int | None]:
        """One microbatch through every stage; `on_layer(i)` as soon as the stage holding
        layer i is done with it, so a prefill ships stage s's layers while s + 1 computes.
        `on_submit()` once it is queued on every stage: another caller's microbatch may
        follow it down the pipeline from then on."""
        microbatch = self.submit(seqs, num_new_tokens, pad_to)
        if on_submit is not None:
            on_submit()
        if on_layer is not None:
            for index, spec in enumerate(self.specs):
                try:
                    self.wait_stage(microbatch, index)
                except BaseException:
                    self.result(microbatch)  # raises the stage's error, counted done
                    raise
                for layer in spec.layers:
                    on_layer(layer)
        return self.result(microbatch)

    def warmup(self, shapes: Iterable[Shape]) -> dict[Shape, float]:
        """Each shape once on every stage; the seconds each took on them all."""
        seconds = {}
        for shape in shapes:
            start = time.perf_counter()
            for stage in self.stages:
                stage.warmup([shape])
            seconds[shape] = time.perf_counter() - start
        return seconds

    # -- counters ----------------------------------------------------------------------------

    def stats(self, spans: bool = False, fresh: bool = False) -> PipelineStats:
        """Counters; `spans` adds the recent stage spans and the hand-off time measured on
        them; `fresh` waits for remote stages' current clocks (else their last report)."""
        clocks = [stage.clock(spans, fresh) for stage in self.stages]
        with self._lock:
            active = self._active_s
            if self._in_flight:
                active += time.time() - self._active_since
            in_flight, count = self._in_flight, self._microbatches
        spans = sorted((s for _, _, spans in clocks for s in spans), key=lambda s: s.start)
        return PipelineStats(
            num_stages=self.num_stages,
            in_flight=in_flight,
            microbatches=count,
            active_s=active,
            busy_s=[busy for busy, _, _ in clocks],
            handoff_s=handoff_seconds(spans, self.num_stages),
            spans=spans,
        )

    def shutdown(self) -> None:
        for stage in self.stages:
            stage.shutdown()
