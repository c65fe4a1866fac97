"""The Controller's configuration: model, worker counts and placement, transport, buckets."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt
from pydantic import AfterValidator, Field

from bucketserve.bucket_manager.config import BucketManagerConfig
from bucketserve.controller.pd_scheduler import PREFILL_PATHS
from bucketserve.kv_worker.config import WorkerConfig
from bucketserve.runtime.core.scheduler import SchedulerConfig
from bucketserve.runtime.worker.model_runner import ModelRunnerConfig
from bucketserve.utils.checks import check_choice, check_pace
from bucketserve.utils.settings import Settings

Execution = Literal["auto", "eager", "graphs"]


def _core_ids(cpus: list[int] | None) -> list[int] | None:
    if cpus is not None and (not cpus or len(set(cpus)) != len(cpus)):
        raise ValueError(f"must be null or a list of distinct core ids >= 0; got {cpus!r}")
    return cpus


class PlacementConfig(Settings):
    """Where one role's Ray actors go (the config file's `controller.prefill` and
    `controller.decode` sections extend it). A worker with `pipeline_parallel_size` > 1 is
    a group of stage actors next to its own actor, which holds the scheduler and no card;
    with `tensor_parallel_size` > 1, a placement group of a bundle per rank, the worker's
    actor rank 0 in bundle 0. Without `torch_threads` a worker's pool takes all the node's
    cores whatever its role: a co-located pair takes turns more than it overlaps, since a
    burst's prefill batch runs while the decode pool waits for it, and the worker pool
    makes idle OpenMP threads sleep rather than spin."""

    accelerator: Literal["auto", "hpu", "gpu", "none"] = "auto"
    """A card per actor: hpu (resources HPU: 1), gpu (num_gpus 1), none, or auto: the card
    the cluster has."""
    num_cpus: float = Field(1.0, ge=0)
    """Ray CPUs per actor."""
    resources: dict[str, Annotated[float, Gt(0)]] = Field(default_factory=dict)
    """Extra Ray resources per actor, e.g. {prefill_node: 1} to pin the role to nodes."""
    torch_threads: int | None = Field(None, ge=1)
    """Intra-op threads per actor; null: all the node's cores, or len(cpus)."""
    cpus: Annotated[list[Annotated[int, Ge(0)]] | None, AfterValidator(_core_ids)] = None
    """Pin each actor to these core ids, e.g. [0]; disjoint lists per role partition one
    machine."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """Pipeline stages per worker: a group of that many stage actors, one card each."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks per worker, each layer sharded over them: a Ray actor per rank, one card each,
    in one placement group (packed as stage_packing says); with pipeline_parallel_size > 1
    each stage is a group of that many ranks (colocated topology only). In the disaggregated
    topology it needs mode ray and the same size for prefill and decode."""
    stage_packing: Literal["PACK", "STRICT_PACK"] = "PACK"
    """How a worker's stage actors (or tensor-parallel ranks) are placed: PACK (one node
    where possible) or STRICT_PACK (only on one node)."""
    execution: Execution | None = None
    """eager, graphs or auto for this role; null: model.execution."""


@dataclass
class ControllerConfig:
    """Everything the Controller starts and serves with.

    `runner` configures every worker's model runner (its `num_kv_blocks` sizes
    the decode pools; `prefill_kv_blocks` the prefill pools, which only hold
    batches until their handoff is acknowledged). `mode="local"` runs all
    workers in this process on threads with the in-process transport; `ray`
    makes them actors (local Ray, or `ray_address`, "auto" to join).
    `transport="auto"`: in-process locally; on Ray the device collective
    when every worker sits on CUDA or HPU, else the Ray object store.
    `buckets=None` derives request and shape buckets from the model.
    `topology="disaggregated"` hands each prefill batch's KV from a prefill worker to a
    decode worker; `"colocated"` runs no prefill workers: each decode worker's engine
    prefills its batches itself, chunked into its decode steps under the scheduler's
    token budget, so no KV moves and decode never waits behind a whole long prompt.
    The decode engines schedule by priority (`scheduler.scheduling_policy`): a request
    ranks by its tenant's priority, then its own, so in the colocated topology, where a
    batch joins the engine as soon as the pool has room, tenant priorities still order
    the prompts waiting for the token budget; a prompt past its TTFT deadline yields to
    those on time it would make late, for at most `scheduler.late_yield_s`, which bounds
    the TTFT tail an overload gives the prompts that yield. A prompt longer than
    `scheduler.long_prefill_token_threshold` (512) computes in chunks of that size, one long
    prompt at a time, so a short prompt arriving meanwhile waits for a chunk, not the whole.
    `remote_prefill` (disaggregated only): `auto` sends each request to a prefill worker or
    lets its decode worker prefill it in its own steps, whichever costs less now
    (`PDScheduler.route`: its uncached tokens, each side's queue, the decode worker's running
    requests and step budget, the KV's transfer time); `always` prefills every prompt on a
    prefill worker, `never` none (the decode workers prefill, as colocated).
    `decode_pace` (disaggregated only): while a prefill batch for a decode worker is in
    flight, its steps wait until a running request would otherwise get its next token
    later than this fraction of its TPOT target, so a prefill worker on the same cores gets
    them (`bucketserve.decode_worker.pacer`); requests without a TPOT target are never held. None
    (the default) never holds a step.
    """

    runner: ModelRunnerConfig = field(default_factory=ModelRunnerConfig)
    scheduler: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(
            scheduling_policy="priority", late_yield_s=8.0, long_prefill_token_threshold=512
        )
    )
    pipeline_depth: int = 1
    prefill_kv_blocks: int | None = None
    num_prefill: int = 1
    num_decode: int = 1
    topology: str = "colocated"  # one machine: no KV moves, prefill never waits for a device
    mode: str = "ray"
    transport: str = "auto"
    ray_address: str | None = None
    ray_init_kwargs: dict[str, Any] = field(default_factory=dict)
    prefill_placement: PlacementConfig = field(default_factory=PlacementConfig)
    decode_placement: PlacementConfig = field(default_factory=PlacementConfig)
    max_restarts: int = -1
    buckets: BucketManagerConfig | None = None
    pad_to_shape_buckets: str | bool = WorkerConfig.pad_to_shape_buckets
    warmup: str = WorkerConfig.warmup
    lease_ttl_s: float = WorkerConfig.lease_ttl_s
    worker_timeout_s: float = 120.0  # a worker call or decode step this long: it hangs
    max_queued_requests: int = 4096
    max_batches_per_prefill: int = 2  # in flight at one prefill worker, so it never idles
    max_requeues: int = 3  # re-prefills of one request before it ends with an error
    stats_interval_s: float = 1.0
    placement_timeout_s: float = 300.0  # for Ray to place a worker (an autoscaler adds nodes)
    decode_pace: float | None = None
    remote_prefill: str = "auto"  # disaggregated: PREFILL_PATHS, per request by cost

    def __post_init__(self) -> None:
        """The rules that tie fields together; the config file's models check each value
        (`bucketserve.deploy.serve_settings`)."""
        if self.mode == "local" and self.transport not in ("auto", "inprocess"):
            raise ValueError(
                f"mode 'local' keeps every worker in this process, so transport must be 'auto' "
                f"or 'inprocess'; got {self.transport!r} (use mode 'ray' for it)"
            )
        if self.mode == "ray" and self.transport == "inprocess":
            raise ValueError("transport 'inprocess' needs mode 'local': Ray actors are processes")
        check_pace("ControllerConfig.decode_pace", self.decode_pace)
        check_choice("ControllerConfig.remote_prefill", self.remote_prefill, PREFILL_PATHS)
        if self.colocated and self.decode_pace is not None:
            raise ValueError(
                "ControllerConfig.decode_pace holds decode steps for a prefill worker's "
                "batches; the colocated topology has none (its engine prefills within its "
                "steps): leave decode_pace out or use topology 'disaggregated'"
            )
        for key, why in (
            ("pipeline_parallel_size", "stage i hands the KV of its layers to decode stage i, "
             "which must hold the same layers"),
            ("tensor_parallel_size", "rank r hands its KV heads to decode rank r, which must "
             "hold the same heads"),
        ):  # fmt: skip
            prefill = getattr(self.prefill_placement, key)
            decode = getattr(self.decode_placement, key)
            if not self.colocated and prefill != decode:
                raise ValueError(
                    f"controller.prefill.{key} ({prefill}) and controller.decode.{key} "
                    f"({decode}) must be equal: prefill {why}"
                )
        for role in ("decode",) if self.colocated else ("prefill", "decode"):
            tp = self.placement(role).tensor_parallel_size
            if tp > 1 and not self.colocated and self.placement(role).pipeline_parallel_size > 1:
                raise ValueError(
                    f"controller.{role}: tensor_parallel_size and pipeline_parallel_size > 1 "
                    "in the disaggregated topology: stage groups hand KV over through their "
                    "heads, which hold only rank 0's KV heads; set one of them to 1"
                )
            if tp > 1 and not self.colocated and self.mode == "local":
                raise ValueError(
                    f"controller.{role}.tensor_parallel_size {tp} in the disaggregated topology "
                    "needs mode 'ray': in local mode a worker's ranks are its child "
                    "processes, which no KV transport reaches"
                )
        prefill = self.prefill_placement.pipeline_parallel_size
        decode = self.decode_placement.pipeline_parallel_size
        if self.transport == "collective" and max(prefill, decode) > 1:
            raise ValueError(
                "transport 'collective' pairs whole workers on their devices; stage groups "
                "(pipeline_parallel_size > 1) hand KV over through their heads: use 'ray'"
            )

    @property
    def colocated(self) -> bool:
        return self.topology == "colocated"

    @property
    def num_prefill_workers(self) -> int:
        """Prefill workers to start: none when colocated."""
        return 0 if self.colocated else self.num_prefill

    @property
    def resolved_transport(self) -> str:
        """The transport before devices are known: collective is chosen only when asked for,
        or later by the worker pool when every worker reports an accelerator."""
        if self.transport != "auto":
            return self.transport
        return "inprocess" if self.mode == "local" else "ray"

    def prefill_runner(self) -> ModelRunnerConfig:
        runner = self.role_runner("prefill")
        if self.prefill_kv_blocks is None:
            return runner
        return dataclasses.replace(runner, num_kv_blocks=self.prefill_kv_blocks)

    def role_runner(self, role: str) -> ModelRunnerConfig:
        """The runner config of one role: its placement's `execution` over the model's."""
        placement = self.prefill_placement if role == "prefill" else self.decode_placement
        if placement.execution is None:
            return self.runner
        return dataclasses.replace(self.runner, execution=placement.execution)

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
        decode_processes = self.num_decode * self.decode_placement.pipeline_parallel_size
        return role == "decode" and decode_processes == 1

    @property
    def shares_cores(self) -> bool:
        """More than one worker process may run on the same cores: several workers (or
        stage actors), not pinned to cores (`cpus`)."""
        workers = (
            self.num_prefill_workers * self.prefill_placement.pipeline_parallel_size
            + self.num_decode * self.decode_placement.pipeline_parallel_size
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
        return self.prefill_placement if role == "prefill" else self.decode_placement

