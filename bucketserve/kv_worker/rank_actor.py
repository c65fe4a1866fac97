"""A worker's tensor-parallel group on Ray: the worker's actor is rank 0 (its scheduler,
block manager and sampler), each other rank a RankActor in its own bundle of the worker's
placement group, one card each."""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any

import torch
import torch.distributed as dist

from bucketserve.kv_worker.worker_env import accelerator_ids, apply_torch_threads, node_id
from bucketserve.runtime.distributed.tp_group import TPGroup, backend_for
from bucketserve.runtime.worker.device import Device
from bucketserve.runtime.worker.model_runner import ModelRunner, ModelRunnerConfig
from bucketserve.runtime.worker.tensor_parallel.tp_runner import TensorParallelRunner

_GROUP_IDS = itertools.count()


class RankActor:
    """One rank other than the head: its shard of the model and of the KV pool. Ray runs
    its calls one at a time in the order the head sends them, so it runs every forward
    the head runs and meets it in the same collectives."""

    def __init__(
        self,
        config: ModelRunnerConfig,
        rank: int,
        size: int,
        backend: str,
        host: str,
        port: int,
        group: str,
        timeout_s: float,
        torch_threads: int | None,
    ) -> None:
        apply_torch_threads(torch_threads)
        if config.device.startswith("cuda"):  # the one card Ray gave this actor
            config = dataclasses.replace(config, device="cuda:0")
            torch.cuda.set_device(0)
        store = dist.TCPStore(host, port, size, is_master=False)
        tp = TPGroup.create(backend, store, rank, size, group, timeout_s)
        self.runner = ModelRunner(config, tp=tp)

    def call(self, method: str, args: tuple) -> None:
        getattr(self.runner, method)(*args)

    def info(self) -> dict:
        return {"pid": os.getpid(), "node_id": node_id(), "accelerator_ids": accelerator_ids()}


class RayTensorParallelRunner(TensorParallelRunner):
    """`TensorParallelRunner` whose other ranks are RankActors (rank r in bundle r of
    `options["placement_group"]`, with the rest of `options`) instead of child processes;
    the group rendezvouses on a TCPStore at this node's address. A rank actor is owned by
    this process: it goes when the worker goes, and a dead one fails the next step."""

    def __init__(
        self,
        config: ModelRunnerConfig,
        size: int,
        options: dict[str, Any],
        torch_threads: int | None,
        name: str,
        timeout_s: float = 300.0,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        device_type = Device(config.device).type
        backend = backend_for(device_type)
        if device_type == "cuda":
            config = dataclasses.replace(config, device="cuda:0")
        host = ray.util.get_node_ip_address()
        group = f"tp-{name}-{os.getpid()}-{next(_GROUP_IDS)}"
        store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False)
        opts = {k: v for k, v in options.items() if k != "placement_group"}
        pg = options.get("placement_group")
        self.ranks = []  # the base class's processes: none here
        self.actors: list[Any] = []
        self._last: list[Any] = []
        self._tp: TPGroup | None = None
        for rank in range(1, size):
            if pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=rank
                )
            actor = (
                ray.remote(RankActor)
                .options(name=f"{group}-rank{rank}", max_restarts=0, max_task_retries=0, **opts)
                .remote(config, rank, size, backend, host, store.port, group, timeout_s,
                        torch_threads)
            )  # fmt: skip
            self.actors.append(actor)
        self._store = store
        try:
            tp = TPGroup.create(backend, store, 0, size, group, timeout_s)
            self._tp = tp
            ModelRunner.__init__(self, config, tp)
            self.rank_infos: list[dict] = ray.get(
                [a.info.remote() for a in self.actors], timeout=timeout_s
            )
        except BaseException:
            self.shutdown()
            raise

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.actors) + 1

    @property
    def rank_pids(self) -> list[int]:
        return [info["pid"] for info in self.rank_infos]

    def alive(self) -> bool:
        """False once a rank's last call has failed (a dead actor fails every call)."""
        import ray

        if not self._last:
            return True
        done, _ = ray.wait(self._last, num_returns=len(self._last), timeout=0)
        try:
            ray.get(done)
        except ray.exceptions.RayError:
            return False
        return True

    def _send(self, method: str, *args: Any) -> None:
        self._last = [a.call.remote(method, args) for a in self.actors]

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self._tp is not None:
            self._tp.close()
            self._tp = None
