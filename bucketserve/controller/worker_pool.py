"""Starts the workers a ControllerConfig names: Ray actors (local Ray or a cluster) or
in-process workers, warmed up and wired to their KV transport."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

from bucketserve.bucket_manager.config import BucketManagerConfig
from bucketserve.controller.config import ControllerConfig, PlacementConfig
from bucketserve.controller.local_ray import start_local_ray
from bucketserve.controller.stage_group import RankGroupPlacement, StageGroupPlacement
from bucketserve.controller.worker_handle import (
    Failure,
    LocalWorkerHandle,
    RayWorkerHandle,
    WorkerHandle,
)
from bucketserve.decode_worker.config import DecodeWorkerConfig
from bucketserve.kv_worker.config import WorkerSettings
from bucketserve.kv_worker.worker_env import omp_env
from bucketserve.messages import WorkerStats
from bucketserve.prefill_worker.config import PrefillWorkerConfig
from bucketserve.runtime.engine.engine_config import EngineConfig, ParallelConfig

logger = logging.getLogger(__name__)

ACTOR_CONCURRENCY = 8  # threads per actor: a long-poll, admissions, reservations, stats
_COLLECTIVE_DEVICES = ("cuda", "hpu")


class WorkerPool:
    """Creates P prefill and D decode workers (`start`), brings a dead one back (`revive`),
    forms the KV collective group, and finds handles by role or name."""

    def __init__(self, config: ControllerConfig, buckets: BucketManagerConfig) -> None:
        self.config = config
        self.buckets = buckets
        self.transport = config.resolved_transport
        self.handles: list[WorkerHandle] = []
        self.infos: dict[str, dict] = {}
        self._started_ray = False
        self._store: Any = None
        self._generation = 0
        self._placement_groups: list[Any] = []

    async def start(self) -> list[WorkerHandle]:
        """Create every worker and warm it up; prefill handles first, then decode."""
        if self.config.mode == "local":
            self.handles = self._local_handles()
        else:
            self.handles = await self._placed(self._ray_handles())
        for handle in self.handles:
            handle.timeout_s = self.config.worker_timeout_s
        if self.config.mode == "local":  # one process: one model load / graph capture at a time
            reports = [await self._start_one(h) for h in self.handles]
        else:
            reports = await asyncio.gather(*(self._start_one(h) for h in self.handles))
        self.infos = {h.name: r for h, r in zip(self.handles, reports, strict=True)}
        if self.config.transport == "auto" and self._all_on_accelerators():
            self.transport = "collective"
        if self.transport == "collective":
            self._check_chips_apart()
            await self._form_collective()
        logger.info(
            "started %d prefill + %d decode workers (%s mode, %s transport)",
            sum(h.role == "prefill" for h in self.handles),
            sum(h.role == "decode" for h in self.handles),
            self.config.mode,
            self.transport,
        )
        return self.handles

    async def revive(self, handle: WorkerHandle) -> None:
        """Wait for (Ray) or build (local) a fresh life of `handle`'s worker and warm it up."""
        await self._start_one(handle)
        handle.restarts += 1
        if self.transport == "collective":
            await self._form_collective(handle)

    def role(self, role: str, alive: bool = False) -> list[WorkerHandle]:
        """The handles of `role` in start order (only the live ones with `alive`)."""
        return [h for h in self.handles if h.role == role and (h.alive or not alive)]

    def serving(self) -> bool:
        """A live worker for every phase: decode, and prefill unless the shape is colocated."""
        if not self.role("decode", alive=True):
            return False
        return self.config.colocated or bool(self.role("prefill", alive=True))

    def by_name(self, name: str | None) -> WorkerHandle:
        for handle in self.handles:
            if handle.name == name:
                return handle
        raise ValueError(f"no worker named {name!r}; workers: {[h.name for h in self.handles]}")

    async def poll(self, handle: WorkerHandle) -> list[Failure]:
        """Fetch `handle`'s fresh stats; the failed call, if it failed."""
        epoch = handle.epoch
        try:
            stats = await handle.call("stats")
        except Exception as exc:
            return [Failure(handle, exc, epoch)]
        if handle.epoch == epoch:
            handle.stats = stats
        return []

    async def refresh(self) -> list[Failure]:
        """Every live worker's fresh stats; the calls that failed."""
        polls = await asyncio.gather(*(self.poll(h) for h in self.handles if h.alive))
        return [f for failures in polls for f in failures]

    def worker_stats(self) -> list[WorkerStats]:
        """Each worker's last report, with the pool's view of its liveness and restarts."""
        return [
            dataclasses.replace(
                h.stats or WorkerStats(h.name, h.role, "", 0, 0), alive=h.alive, restarts=h.restarts
            )
            for h in self.handles
        ]

    async def shutdown(self) -> None:
        await asyncio.gather(*(h.stop() for h in self.handles), return_exceptions=True)
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False
        elif self._placement_groups:
            from ray.util import remove_placement_group

            for pg in self._placement_groups:
                remove_placement_group(pg)
        self._placement_groups = []

    async def _placed(self, handles: list[WorkerHandle]) -> list[WorkerHandle]:
        """The workers Ray placed within `placement_timeout_s` (time for an autoscaler to add
        nodes for the rest); the others are killed and named. Each role needs one."""
        timeout = self.config.placement_timeout_s
        results = await asyncio.gather(
            *(asyncio.wait_for(h.start(), timeout) for h in handles), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.TimeoutError):
                raise result
        placed = [h for h, r in zip(handles, results, strict=True) if r is None]
        missing = [h for h in handles if h not in placed]
        if not missing:
            return placed
        await asyncio.gather(*(h.stop() for h in missing), return_exceptions=True)
        names = ", ".join(h.name for h in missing)
        lacking = {h.role for h in handles} - {h.role for h in placed}
        if lacking:
            raise RuntimeError(
                f"no room in the cluster for {names} after {timeout:g}s, and every "
                f"{' and '.join(sorted(lacking))} worker is among them; "
                "add nodes (or max_workers) or lower num_workers"
            )
        logger.warning(
            "starting with %d of %d workers: %s not placed within %gs (no room in the cluster, "
            "and no node added for them in time); add nodes or lower num_workers",
            len(placed), len(handles), names, timeout,
        )
        return placed

    # -- worker configs ----------------------------------------------------------------------

    def prefill_config(self, index: int) -> PrefillWorkerConfig:
        runner = self.config.prefill_runner()
        return PrefillWorkerConfig(
            runner=runner,
            cache_shares=self._cache_shares(),
            **self._shared("prefill", index),
        )

    def _cache_shares(self) -> dict[str, float] | None:
        """Each tenant's bound on a pool's evictable blocks (those with one)."""
        shares = {t.name: t.cache_share for t in self.buckets.tenants if t.cache_share}
        return shares or None

    def decode_config(self, index: int) -> DecodeWorkerConfig:
        c = self.config
        return DecodeWorkerConfig(
            engine=EngineConfig(
                runner=c.role_runner("decode"),
                scheduler=c.decode.model_copy(update={"cache_shares": self._cache_shares()}),
            ),
            **self._shared("decode", index),
            stall_timeout_s=c.worker_timeout_s,
            prefills=c.colocated or c.remote_prefill != "always",
            pace=c.decode.pace,
        )

    def _shared(self, role: str, index: int) -> dict[str, Any]:
        """The WorkerConfig fields both roles take from the controller's config."""
        c = self.config
        placement = c.placement(role)
        return {
            **{k: getattr(c, k) for k in WorkerSettings.model_fields},
            **{k: getattr(placement, k) for k in ParallelConfig.model_fields},
            "name": f"{role}-{index}",
            "shape_buckets": self.buckets.shape_buckets,
            "transport": self._worker_transport(),
            "torch_threads": c.torch_threads(role),
            "cpus": c.cpus(role),
        }

    def _worker_transport(self) -> str:
        """What a worker builds alone; a collective group is joined after start."""
        return "inprocess" if self.config.mode == "local" else "ray"

    # -- local -------------------------------------------------------------------------------

    def _local_handles(self) -> list[WorkerHandle]:
        from bucketserve.decode_worker.decode_worker import DecodeWorker
        from bucketserve.kv_transfer.inprocess import InProcessTransport
        from bucketserve.prefill_worker.prefill_worker import PrefillWorker

        transport = InProcessTransport()

        def prefill(i: int):
            return lambda: PrefillWorker(self.prefill_config(i), transport)

        def decode(i: int):
            def make() -> DecodeWorker:
                worker = DecodeWorker(self.decode_config(i), transport)
                transport.register(worker.name, worker)
                return worker

            return make

        handles: list[WorkerHandle] = [
            LocalWorkerHandle(f"prefill-{i}", "prefill", prefill(i), threads=4)
            for i in range(self.config.num_prefill_workers)
        ]
        handles += [
            LocalWorkerHandle(f"decode-{i}", "decode", decode(i), threads=ACTOR_CONCURRENCY)
            for i in range(self.config.decode.num_workers)
        ]
        return handles

    # -- Ray ---------------------------------------------------------------------------------

    def _ray_handles(self) -> list[WorkerHandle]:
        import ray

        from bucketserve.decode_worker.decode_worker import DecodeWorker
        from bucketserve.prefill_worker.prefill_worker import PrefillWorker

        if not ray.is_initialized():
            # A Ray this process starts runs its workers at nice 0, not Ray's 15: the
            # engine is the workload, and at 15 the gateway and Ray's daemons preempt it.
            # Cluster recipes set it on `ray start`.
            os.environ.setdefault("RAY_worker_niceness", "0")
            if self.config.ray_address is None:
                start_local_ray(**self.config.ray_init_kwargs)
            else:
                kwargs = {"include_dashboard": False, **self.config.ray_init_kwargs}
                ray.init(address=self.config.ray_address, **kwargs)
            self._started_ray = True
        c = self.config
        groups = {
            role: _group_placement(self.actor_options(role, placement), placement)
            for role, placement in (
                ("prefill", c.prefill), ("decode", c.decode)
            )
        }
        counts = {"prefill": c.num_prefill_workers, "decode": c.decode.num_workers}
        if c.ray_address is None:  # a Ray started here: no autoscaler adds nodes to it
            wanted = [
                opts
                for role, group in groups.items()
                for opts in (
                    group.feasibility_options() if _placement_group(group) else [group.options]
                ) * counts[role]
            ]
            _check_feasible(wanted, ray.cluster_resources())
        classes = {"prefill": PrefillWorker, "decode": DecodeWorker}
        configs = {"prefill": self.prefill_config, "decode": self.decode_config}
        handles: list[WorkerHandle] = []
        for role in ("prefill", "decode"):
            group = groups[role]
            for i in range(counts[role]):
                config, options = configs[role](i), group.options
                if _placement_group(group):  # one per worker: head + stages, or the ranks
                    pg, options, stage_options = group.create()
                    self._placement_groups.append(pg)
                    config = config.model_copy(update={"stage_options": stage_options})
                actor = ray.remote(classes[role]).options(**options).remote(config)
                handles.append(RayWorkerHandle(f"{role}-{i}", role, actor))
        return handles

    def actor_options(self, role: str, placement: PlacementConfig) -> dict[str, Any]:
        """Ray options for one actor of `role`: an accelerator card each, restartable."""
        import ray

        accelerator = placement.accelerator
        if accelerator == "auto":
            cluster = ray.cluster_resources()
            accelerator = "hpu" if cluster.get("HPU") else "gpu" if cluster.get("GPU") else "none"
        options: dict[str, Any] = {
            **worker_resources(placement, accelerator),
            "max_restarts": self.config.max_restarts,
            "max_task_retries": 0,  # a crashed call is retried by the controller, not re-run
            "max_concurrency": ACTOR_CONCURRENCY,
        }
        threads = self.config.torch_threads(role)
        if threads:
            options["runtime_env"] = {"env_vars": omp_env(threads, self.config.omp_spins(role))}
        return options

    # -- shared ------------------------------------------------------------------------------

    async def _start_one(self, handle: WorkerHandle) -> dict:
        await handle.start()
        return await handle.warm_up()

    def _all_on_accelerators(self) -> bool:
        """Every worker on one accelerator kind, and no prefill worker on a chip a decode
        worker uses: NCCL refuses two ranks of a group on one GPU ("Duplicate GPU")."""
        kinds = {info["device_type"] for info in self.infos.values()}
        return len(kinds) == 1 and kinds <= set(_COLLECTIVE_DEVICES) and not self._shared_chip()

    def _shared_chip(self) -> tuple[str, str, str] | None:
        """(prefill worker, decode worker, chip) of the first pair on one accelerator."""
        chips = {name: _chips(info) for name, info in self.infos.items()}
        roles = {name: info["role"] for name, info in self.infos.items()}
        for p in (n for n in chips if roles[n] == "prefill"):
            for d in (n for n in chips if roles[n] == "decode"):
                shared = chips[p] & chips[d]
                if shared and self.infos[p]["device_type"] in _COLLECTIVE_DEVICES:
                    return p, d, sorted(shared)[0]
        return None

    def _check_chips_apart(self) -> None:
        """ValueError where a prefill and a decode worker share an accelerator, which NCCL
        would refuse deep in the first transfer."""
        shared = self._shared_chip()
        if shared is not None:
            p, d, chip = shared
            raise ValueError(
                f"controller.transport 'collective' needs each prefill and decode worker on "
                f"its own accelerator, but {p} and {d} share {chip} (NCCL refuses two ranks "
                "on one GPU): set controller.transport to 'auto' or 'ray', or give each "
                "worker a whole card (controller.prefill.accelerator and "
                "controller.decode.accelerator: gpu or hpu)"
            )

    async def _form_collective(self, revived: WorkerHandle | None = None) -> None:
        """Form one KV group per prefill/decode pair, or after a restart only the pairs of the
        `revived` worker with its live peers: survivors keep every other group. A fresh store
        prefix per generation, so a new life never meets its predecessor's rendezvous."""
        import ray
        import torch.distributed as dist

        from bucketserve.kv_transfer.collective import PairSpec
        from bucketserve.kv_transfer.collective_group import RECEIVER_RANK, SENDER_RANK

        host = ray.util.get_node_ip_address()
        if self._store is None:
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self._generation += 1
        pairs: dict[str, list[PairSpec]] = {}
        by_name = {h.name: h for h in self.handles}
        for p in (h for h in self.handles if h.role == "prefill"):
            for d in (h for h in self.handles if h.role == "decode"):
                if revived is not None and (revived not in (p, d) or not (p.alive and d.alive)):
                    continue
                prefix = f"kv-{self._generation}/{p.name}-{d.name}/"
                pairs.setdefault(p.name, []).append(PairSpec(d.name, prefix, SENDER_RANK))
                pairs.setdefault(d.name, []).append(PairSpec(p.name, prefix, RECEIVER_RANK))
        timeout_s = self.config.lease_ttl_s
        port = self._store.port
        await asyncio.gather(*(
            by_name[name].call("init_collective", host, port, specs, timeout_s)
            for name, specs in pairs.items()
        ))


def _group_placement(
    options: dict[str, Any], placement: PlacementConfig
) -> StageGroupPlacement | RankGroupPlacement:
    if placement.tensor_parallel_size > 1 and placement.pipeline_parallel_size == 1:
        return RankGroupPlacement(options, placement)
    return StageGroupPlacement(options, placement)


def _placement_group(group: StageGroupPlacement | RankGroupPlacement) -> bool:
    """Whether each worker of the group gets a placement group of its own."""
    if isinstance(group, RankGroupPlacement):
        return True
    return group.num_stages > 1


def worker_resources(placement: PlacementConfig, accelerator: str) -> dict[str, Any]:
    """What one worker's actor (or one tensor-parallel rank's: the worker's placement group
    has a bundle of these per rank, `RankGroupPlacement`) asks Ray for: a card
    (`accelerator` "hpu" or "gpu", resolved) and `num_cpus`."""
    out: dict[str, Any] = {"num_cpus": placement.num_cpus}
    resources = dict(placement.resources)
    if accelerator == "hpu":
        resources["HPU"] = 1
    elif accelerator == "gpu":
        out["num_gpus"] = 1
    if resources:
        out["resources"] = resources
    return out


def _check_feasible(options: list[dict[str, Any]], cluster: dict[str, float]) -> None:
    """Raise ValueError when the actors ask for more of a resource than the whole cluster
    has (Ray would leave them pending forever)."""
    wanted: dict[str, float] = {}
    for opts in options:
        for name, amount in (
            ("CPU", opts.get("num_cpus", 1)),
            ("GPU", opts.get("num_gpus", 0)),
            *opts.get("resources", {}).items(),
        ):
            wanted[name] = wanted.get(name, 0) + amount
    short = {k: (v, cluster.get(k, 0)) for k, v in wanted.items() if v > cluster.get(k, 0)}
    if short:
        detail = ", ".join(
            f"{k}: {v:g} wanted, {have:g} in the cluster" for k, (v, have) in short.items()
        )
        raise ValueError(
            f"the workers cannot all be placed ({detail}); lower a role's num_workers, "
            "change the placement, or add nodes"
        )


def _chips(info: dict) -> set[str]:
    """The physical accelerators a worker computes on: the ids Ray assigned it on its node,
    else (one process, local mode) its device."""
    node = info.get("node_id") or "local"
    ids = info.get("accelerator_ids") or {}
    if ids:
        return {f"{node}/{kind}:{i}" for kind, values in ids.items() for i in values}
    return {f"{node}/{info['device']}"}
