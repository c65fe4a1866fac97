"""The Controller's configuration: model, worker counts and placement, transport, buckets."""

from __future__ import annotations

import logging
import os
from typing import Annotated, Any, Literal

from annotated_types import Gt
from pydantic import Field, InstanceOf, model_validator

from bucketserve.bucket_manager.config import BucketManagerConfig
from bucketserve.decode_worker.config import PacingSettings
from bucketserve.kv_worker.config import ProcessSettings, WorkerSettings
from bucketserve.runtime.core.scheduler import SchedulerConfig
from bucketserve.runtime.engine.engine_config import ParallelConfig
from bucketserve.runtime.worker.runner_config import Execution, ModelRunnerConfig
from bucketserve.utils.settings import SettingsError

logger = logging.getLogger(__name__)


class PlacementConfig(ParallelConfig, ProcessSettings):
    """How many workers of one role, and where their Ray actors go (the config file's
    `controller.prefill` and `controller.decode` sections extend it). A worker with
    `pipeline_parallel_size` > 1 is a group of stage actors next to its own actor, which
    holds the scheduler and no card; with `tensor_parallel_size` > 1, a placement group of a
    bundle per rank, the worker's actor rank 0 in bundle 0. Without `torch_threads` a
    worker's pool takes all the node's cores whatever its role: a co-located pair takes
    turns more than it overlaps, since a burst's prefill batch runs while the decode pool
    waits for it, and the worker pool makes idle OpenMP threads sleep rather than spin."""

    num_workers: int = Field(1, ge=1)
    """Workers of this role (the colocated topology starts no prefill workers)."""
    accelerator: Literal["auto", "hpu", "gpu", "none"] = "auto"
    """A card per actor: hpu (resources HPU: 1), gpu (num_gpus 1), none, or auto: the card
    the cluster has."""
    num_cpus: float = Field(1.0, ge=0)
    """Ray CPUs per actor."""
    resources: dict[str, Annotated[float, Gt(0)]] = Field(default_factory=dict)
    """Extra Ray resources per actor, e.g. {prefill_node: 1} to pin the role to nodes."""
    stage_packing: Literal["PACK", "STRICT_PACK"] = "PACK"
    """How a worker's stage actors (or tensor-parallel ranks) are placed: PACK (one node
    where possible) or STRICT_PACK (only on one node)."""
    execution: Execution | None = None
    """eager, graphs or auto for this role; null: model.execution."""


class PrefillConfig(PlacementConfig):
    """The prefill workers (the disaggregated topology starts them) and where they go."""

    kv_blocks: int | None = Field(None, ge=1)
    """Prefill pool size; null: as kv_cache. It holds batches until their handoff."""
    max_batches: int = Field(2, ge=1)
    """Batches in flight at one prefill worker (two: it never idles between them)."""


class DecodeConfig(PlacementConfig, SchedulerConfig, PacingSettings):
    """The decode workers, their continuous-batching engines and where they go: the
    engine's keys are `SchedulerConfig`'s, with the service's defaults where they differ
    from the offline engine's (vLLM's)."""

    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    """fcfs, or priority: by tenant priority, then request priority (so in the colocated
    topology tenant priorities still order the prompts waiting for the token budget)."""
    late_yield_s: float | None = Field(8.0, gt=0)
    """Seconds past its TTFT deadline a prompt yields (and is held for running TPOTs)
    before it takes its place back, which bounds the TTFT tail of an overload; null: no
    bound."""
    long_prefill_token_threshold: int = Field(512, ge=0)
    """A prompt with more tokens than this left to compute is long: it computes at most
    this many a step, so a short prompt arriving meanwhile waits for a chunk, not the
    whole prompt (vLLM's knob, off there by default); 0: off, as in the offline `LLM`."""


class ControllerConfig(WorkerSettings):
    """The config file's `controller` section, and what the Controller starts with: the
    model runner every worker builds (`runner`, from the `model` and `kv_cache` sections)
    and the bucket manager's config (`buckets`; None derives request and shape buckets
    from the model), which the code sets. `transport` auto is in-process locally; on Ray
    the device collective when every worker sits on CUDA or HPU, else the Ray object
    store."""

    topology: Literal["disaggregated", "colocated"] = "colocated"
    """disaggregated: prefill workers hand KV to decode workers (separate cards);
    colocated: no prefill workers, each decode worker prefills in chunks within its steps
    (one machine or one card). Named `shape` before: that key is read, with a warning,
    until 0.2."""
    remote_prefill: Literal["auto", "always", "never"] = "auto"
    """disaggregated: auto sends each request to a prefill worker or lets its decode worker
    prefill it, whichever is cheaper now (`PDScheduler.route`: its uncached tokens, each
    side's queue, the decode worker's running requests, the KV transfer); always: every
    prompt on a prefill worker; never: none (the decode workers prefill, as colocated)."""
    mode: Literal["ray", "local"] = "ray"
    """ray: workers are Ray actors; local: threads in this process."""
    ray_address: str | None = None
    """null: start a local Ray; auto: join the running cluster; or host:port."""
    transport: Literal["auto", "ray", "collective", "inprocess"] = "auto"
    """KV transport: ray (object store), collective (NCCL / HCCL), inprocess (mode local),
    or auto."""
    max_restarts: int = Field(-1, ge=-1)
    """Restarts of a dead worker actor (-1: forever)."""
    worker_timeout_s: float = Field(120.0, gt=0)
    """A worker call or decode step taking longer is hung: the worker is restarted."""
    max_queued_requests: int = Field(4096, ge=1)
    """Requests waiting in the bucket manager before new ones are refused."""
    max_requeues: int = Field(3, ge=0)
    """Re-prefills of a request whose decode worker died."""
    stats_interval_s: float = Field(1.0, gt=0)
    """How often workers report their statistics."""
    placement_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for Ray to place the workers (an autoscaler adds nodes); then serve
    with those placed."""
    prefill: PrefillConfig = PrefillConfig()
    """The prefill workers (the disaggregated topology starts them) and where they go."""
    decode: DecodeConfig = DecodeConfig()
    """The decode workers, their continuous-batching engines and where they go."""
    runner: InstanceOf[ModelRunnerConfig] = Field(default_factory=ModelRunnerConfig, exclude=True)
    buckets: InstanceOf[BucketManagerConfig] | None = Field(None, exclude=True)
    ray_init_kwargs: dict[str, Any] = Field(default_factory=dict, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _shape_is_topology(cls, data: Any) -> Any:
        """`shape`, the key's old name: read as `topology`, with a warning, until 0.2."""
        if not isinstance(data, dict) or "shape" not in data:
            return data
        if "topology" in data:
            raise SettingsError(
                "shape", "is the old name of controller.topology: give only topology"
            )
        logger.warning(
            "controller.shape is deprecated: write controller.topology (shape is read until 0.2)"
        )
        data = dict(data)
        data["topology"] = data.pop("shape")
        return data

    @model_validator(mode="after")
    def _mode_and_transport(self) -> ControllerConfig:
        if self.mode == "local" and self.ray_address is not None:
            raise SettingsError(
                "ray_address",
                "mode 'local' runs every worker in this process without Ray; remove "
                "ray_address or set controller.mode to 'ray'",
            )
        if self.mode == "local" and self.transport not in ("auto", "inprocess"):
            raise SettingsError(
                "transport",
                f"mode 'local' keeps every worker in this process, so transport must be "
                f"'auto' or 'inprocess'; got {self.transport!r} (use mode 'ray' for it)",
            )
        if self.mode == "ray" and self.transport == "inprocess":
            raise SettingsError(
                "transport", "transport 'inprocess' needs mode 'local': Ray actors are processes"
            )
        if self.colocated and self.decode.pace is not None:
            raise SettingsError(
                "decode.pace",
                "decode.pace holds decode steps for a prefill worker's batches; the colocated "
                "topology has none (its engine prefills within its steps): leave pace out or "
                "use topology 'disaggregated'",
            )
        stages = max(self.prefill.pipeline_parallel_size, self.decode.pipeline_parallel_size)
        if self.transport == "collective" and stages > 1:
            raise SettingsError(
                "transport",
                "transport 'collective' pairs whole workers on their devices; stage groups "
                "(pipeline_parallel_size > 1) hand KV over through their heads: use 'ray'",
            )
        return self

    @model_validator(mode="after")
    def _parallel_sizes(self) -> ControllerConfig:
        """Each prefill stage (rank) hands its layers' KV (its KV heads) to the decode stage
        (rank) of the same index."""
        if self.colocated:
            return self
        for key, what in (("pipeline_parallel_size", "stage hands the KV of its layers"),
                          ("tensor_parallel_size", "rank hands its KV heads")):
            prefill, decode = getattr(self.prefill, key), getattr(self.decode, key)
            if prefill != decode:
                raise SettingsError(
                    f"decode.{key}",
                    f"controller.prefill.{key} {prefill} and controller.decode.{key} {decode} "
                    f"differ: each prefill {what} to the decode {what.split()[0]} of the same "
                    f"index, so set both to {prefill} or both to {decode} (or use "
                    "controller.topology: colocated)",
                )
        for role in ("prefill", "decode"):
            tp = self.placement(role).tensor_parallel_size
            pp = self.placement(role).pipeline_parallel_size
            if tp > 1 and pp > 1:
                raise SettingsError(
                    f"{role}.tensor_parallel_size",
                    f"tensor_parallel_size {tp} with pipeline_parallel_size {pp} in the "
                    "disaggregated topology: stage groups hand KV over through their heads, "
                    "which hold only rank 0's KV heads; set one of them to 1 or use "
                    "controller.topology: colocated",
                )
            if tp > 1 and self.mode == "local":
                raise SettingsError(
                    f"{role}.tensor_parallel_size",
                    f"tensor_parallel_size {tp} in the disaggregated topology needs "
                    "controller.mode: ray (in local mode a worker's ranks are its child "
                    "processes, which no KV transport reaches)",
                )
        return self

    @property
    def colocated(self) -> bool:
        return self.topology == "colocated"

    @property
    def num_prefill_workers(self) -> int:
        """Prefill workers to start: none when colocated."""
        return 0 if self.colocated else self.prefill.num_workers

    @property
    def resolved_transport(self) -> str:
        """The transport before devices are known: collective is chosen only when asked for,
        or later by the worker pool when every worker reports an accelerator."""
        if self.transport != "auto":
            return self.transport
        return "inprocess" if self.mode == "local" else "ray"

    def prefill_runner(self) -> ModelRunnerConfig:
        runner = self.role_runner("prefill")
        if self.prefill.kv_blocks is None:
            return runner
        return runner.model_copy(update={"num_kv_blocks": self.prefill.kv_blocks})

    def role_runner(self, role: str) -> ModelRunnerConfig:
        """The runner config of one role: its placement's `execution` over the model's."""
        placement = self.placement(role)
        if placement.execution is None:
            return self.runner
        return self.runner.model_copy(update={"execution": placement.execution})

    def torch_threads(self, role: str) -> int | None:
        """Per-actor intra-op threads; None in local mode (one process shares one pool)."""
        if self.mode == "local":
            return None
        placement = self.placement(role)
        if placement.torch_threads is not None:
            return placement.torch_threads
        return len(placement.cpus) if placement.cpus else os.cpu_count() or 1

    def omp_spins(self, role: str) -> bool:
        """Whether `role`'s actors spin between parallel ops
        (`bucketserve.kv_worker.worker_env.omp_env`):
        alone on their cores, yes; sharing them, only a single decode process. Its steps
        are hundreds of short ops, each of which would wait for a sleeping pool to wake,
        while a prefill batch's ops are long enough that waking costs it little, and its
        pool spinning between batches would take the decode's cores."""
        if not self.shares_cores:
            return True
        decode_processes = self.decode.num_workers * self.decode.pipeline_parallel_size
        return role == "decode" and decode_processes == 1

    @property
    def shares_cores(self) -> bool:
        """More than one worker process may run on the same cores: several workers (or
        stage actors), not pinned to cores (`cpus`)."""
        workers = (
            self.num_prefill_workers * self.prefill.pipeline_parallel_size
            + self.decode.num_workers * self.decode.pipeline_parallel_size
        )
        pinned = all(
            self.placement(role).cpus for role in ("prefill", "decode")
            if role == "decode" or self.num_prefill_workers
        )
        return workers > 1 and not pinned

    def cpus(self, role: str) -> list[int] | None:
        """The cores `role`'s actors are pinned to; None in local mode (one process)."""
        return None if self.mode == "local" else self.placement(role).cpus

    def placement(self, role: str) -> PlacementConfig:
        return self.prefill if role == "prefill" else self.decode

