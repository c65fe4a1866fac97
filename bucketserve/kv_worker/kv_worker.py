"""What prefill and decode workers share: a model runner, its KV format, shapes, transport."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from tqdm import tqdm

from bucketserve.bucket_manager.config import ShapeBucketConfig
from bucketserve.bucket_manager.shape_buckets import ShapeBuckets
from bucketserve.kv_transfer.collective import CollectiveTransport, PairSpec
from bucketserve.kv_transfer.collective_group import backend_for
from bucketserve.kv_transfer.kv_format import KVFormat
from bucketserve.kv_transfer.transport import KVTransport, check_transport
from bucketserve.kv_worker.rank_actor import RayTensorParallelRunner
from bucketserve.kv_worker.rank_kv import kv_format_of
from bucketserve.kv_worker.stage_group import new_runner
from bucketserve.kv_worker.worker_env import (
    accelerator_ids,
    apply_torch_threads,
    in_ray_actor,
    new_boot_id,
    node_id,
    pin_cpus,
    resolve_padding,
    warmup_selection,
)
from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.worker.model_runner import ModelRunner, Shape
from bucketserve.runtime.worker.pipeline.pipeline_runner import PipelineRunner
from bucketserve.runtime.worker.pipeline.stage_clock import StageSpan
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from bucketserve.runtime.worker.tensor_parallel.tp_runner import (
    RankDeadError,
    TensorParallelRunner,
)

logger = logging.getLogger(__name__)


class WorkerFailedError(RuntimeError):
    """The worker cannot go on (its loop died, a fault drill): it must be restarted and its
    requests re-prefilled."""


class StepProbe(NamedTuple):
    decode_s: float
    prompt_s: float
    prompt_tokens: int


class KVWorker:
    """Identity (name, boot id, Ray node), the runner and its pool's KV format, the shape
    buckets and whether steps pad to them, and the KV transport. A tensor-parallel
    worker's pool holds its head rank's KV heads: `rank_formats` names every rank's."""

    role = "worker"
    block_manager: BlockManager  # each role's pool bookkeeping, built by the subclass

    def __init__(
        self,
        name: str,
        runner_config: ModelRunnerConfig,
        shape_config: ShapeBucketConfig,
        padding: str | bool,
        transport_name: str,
        transport: KVTransport | None,
        torch_threads: int | None,
        cpus: list[int] | None = None,
        pipeline_parallel_size: int = 1,
        stage_options: dict[str, Any] | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        self.name = name
        self.boot_id = new_boot_id()
        pin_cpus(cpus)
        apply_torch_threads(torch_threads)
        self.runner = new_runner(
            runner_config, pipeline_parallel_size, stage_options, torch_threads, name,
            tensor_parallel_size,
        )
        self.tokenizer = self.runner.tokenizer
        self.shapes = ShapeBuckets(shape_config, log=False)
        # graphs mode runs every step at a shape bucket, so it always pads
        self.padding = self.runner.graphs is not None or resolve_padding(
            padding, self.runner.device.type
        )
        self.kv_format = kv_format_of(self.runner)
        self.rank_formats: tuple[KVFormat, ...] = ()  # one rank: just kv_format
        if isinstance(self.runner, RayTensorParallelRunner):
            self.rank_formats = tuple(self.runner.kv_formats)
        self.transport = transport or default_transport(transport_name)
        self.node_id = node_id()
        self.warmed: list[Shape] = []
        self.warmup_s = 0.0
        self.graph_compile_s = 0.0  # warm-up's compiles (graphs mode)

    def init_collective(
        self, host: str, port: int, pairs: list[PairSpec], timeout_s: float
    ) -> list[str]:
        """Form (or re-form) this worker's KV groups, one per peer in `pairs`; the transport
        becomes the collective one. Returns every peer this worker has a group with. Each
        other tensor-parallel rank forms its own with the peers' rank of its index."""
        device = self.runner.device.torch_device
        backend = backend_for(device.type)
        ranks = []
        if isinstance(self.runner, RayTensorParallelRunner):
            ranks = self.runner.connect_ranks(backend, host, port, pairs, timeout_s)
        if not isinstance(self.transport, CollectiveTransport):
            self.transport = CollectiveTransport(self.name, device, stash_ttl_s=timeout_s)
        self.transport.connect(backend, host, port, pairs, timeout_s)
        if ranks:
            self.runner.wait(ranks)
        return self.transport.peers()

    @property
    def tensor_parallel(self) -> bool:
        return isinstance(self.runner, TensorParallelRunner)

    def group_failed(self, error: RankDeadError) -> None:
        """A tensor-parallel group that failed a step (a rank died, or an error left the
        ranks out of step) cannot run another. In a Ray actor the process exits, as a stage
        group's head does, so Ray's restart (with every rank) is under way before the
        controller next calls it, and it re-prefills the worker's requests; elsewhere
        `error` is raised."""
        if in_ray_actor():
            logger.error("%s: %s; the worker goes down with it", self.name, error)
            logging.shutdown()
            os._exit(1)
        raise error

    @property
    def transport_name(self) -> str:
        return "" if self.transport is None else self.transport.name

    def info(self) -> dict:
        return {
            "name": self.name,
            "role": self.role,
            "boot_id": self.boot_id,
            "node_id": self.node_id,
            "device": str(self.runner.device),
            "device_type": self.runner.device.type,  # cpu / cuda / hpu
            "accelerator_ids": accelerator_ids(),
            "kv_format": self.kv_format,
            "rank_kv_formats": list(self.rank_formats),
            "num_kv_blocks": self.runner.num_kv_blocks,
            "max_model_len": self.runner.max_model_len,
            "stages": list(getattr(self.runner, "stage_infos", [])),
            "rank_pids": list(getattr(self.runner, "rank_pids", [])),  # tensor-parallel ranks
            "ranks": list(getattr(self.runner, "rank_infos", [])),  # each one's pid, node, card
        }

    @property
    def pipelined(self) -> bool:
        """Whether the runner is a stage group (one stage: a ModelRunner)."""
        return isinstance(self.runner, PipelineRunner)

    def pipeline_stats(self) -> dict[str, Any]:
        """The WorkerStats fields of the worker's stage group (one stage: the defaults)."""
        if not isinstance(self.runner, PipelineRunner):
            return {}
        stats = self.runner.stats()
        return {
            "pipeline_stages": stats.num_stages,
            "microbatches_in_flight": stats.in_flight,
            "bubble_fraction": stats.bubble_fraction,
        }

    def pipeline_spans(self) -> list[StageSpan]:
        """The stages' recent busy spans (when each ran which microbatch), fresh."""
        if not isinstance(self.runner, PipelineRunner):
            return []
        return self.runner.stats(spans=True, fresh=True).spans

    def ping(self) -> str:
        return self.boot_id

    def prompt_shape(self, bucket: Shape) -> Shape:
        """A prompt bucket (batch, query, context blocks) as the runner's (batch, query,
        block-table width): the query's own blocks come on top of the context. A query of
        one token is a decode shape to the runner, its blocks the batch's total."""
        bs, query, ctx = bucket
        width = ctx + self.block_manager.blocks_needed(query)
        return (bs, query, bs * width if query == 1 else width)  # query 1: a decode shape

    def probe_steps(self, unified: bool = False, tokens: int = 128) -> StepProbe | None:
        """A one-row decode step and a `tokens`-token prompt step timed on dummy rows, each
        the better of two runs after one unmeasured: what the TTFT forecast prices prompts
        with until served steps are measured (`unified`: as unified steps). None where a
        run would compile a graph or cross processes (graphs mode, stage groups,
        tensor-parallel ranks)."""
        runner = self.runner
        if type(runner) is not ModelRunner or runner.graphs is not None:
            return None
        tokens = min(tokens, runner.max_model_len - 1)
        blocks = self.block_manager.blocks_needed(tokens)
        if unified:
            decode, prompt = (1, 0, 1, 0), (tokens, 0, blocks, 1)
        else:
            decode, prompt = (1, 1, 1), self.prompt_shape((1, tokens, 0))
        runner.warmup([decode, prompt])
        runs = [runner.warmup([decode, prompt]).values() for _ in range(2)]
        decode_s, prompt_s = (min(pair) for pair in zip(*runs, strict=True))
        return StepProbe(decode_s, prompt_s, tokens)

    def _warmup(
        self,
        kind: str,
        mode: str,
        buckets: Sequence[Shape],
        runner_shape: Callable[[Shape], Shape],
    ) -> dict:
        """Run the chosen `kind` buckets once each; logs the bucket config, a progress bar
        and the time taken, so serving never meets a cold configured shape."""
        for line in self.shapes.describe():
            logger.info("%s: %s", self.name, line)
        chosen = warmup_selection(mode, self.padding, list(buckets))
        execution = self.runner.execution
        start = time.perf_counter()
        bar = tqdm(chosen, desc=f"{self.name} {kind} graphs", unit="graph", leave=False)
        for i, bucket in enumerate(bar, 1):
            shape = runner_shape(bucket)
            seconds = self.runner.warmup([shape])[shape]
            self.warmed.append(shape)
            logger.info(
                "%s: [warm-up][%s][%d/%d] %s as %s in %.2f s (%s)",
                self.name, kind, i, len(chosen), bucket, shape, seconds, execution,
            )  # fmt: skip
        self.warmup_s += time.perf_counter() - start
        if self.runner.graphs is not None:
            self.graph_compile_s = self.runner.graphs.stats.total_compile_s
        logger.info(
            "%s: warmed %d of %d %s shapes in %.2f s (%s, padding %s)",
            self.name,
            len(chosen),
            len(buckets),
            kind,
            self.warmup_s,
            execution,
            "on" if self.padding else "off",
        )
        return {
            "shapes": list(self.warmed),
            "seconds": self.warmup_s,
            "padding": self.padding,
            "execution": execution,
        }

    def graph_misses(self, unpadded_batches: int) -> int:
        """Graphs mode: shapes compiled while serving, each counted once; eager: the batches
        that ran unpadded because no bucket held them."""
        stats = self.runner.graph_stats
        return unpadded_batches if stats is None else stats.misses

    def graph_fields(self) -> dict:
        """The WorkerStats fields of graphs mode: compile seconds (warm-up, misses), and
        whether layer-wise KV leaves during the step or after its graph."""
        stats = self.runner.graph_stats
        if stats is None:
            return {"execution": self.runner.execution}
        return {
            "execution": self.runner.execution,
            "graph_compile_s": sum(stats.compile_s.values()),
            "graph_miss_compile_s": stats.miss_compile_s,
            "graphs": len(stats.compile_s) + stats.misses,
            "kv_export": stats.kv_export,
        }


def default_transport(name: str) -> KVTransport | None:
    """The transport a worker can build alone: `ray`. `inprocess` is shared by the workers of
    one process and `collective` needs its group, so those are handed in later."""
    check_transport(name)
    if name == "ray":
        from bucketserve.kv_transfer.ray_store import RayObjectStoreTransport

        return RayObjectStoreTransport()
    return None
