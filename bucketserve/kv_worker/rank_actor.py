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

from bucketserve.kv_transfer.collective import PairSpec
from bucketserve.kv_transfer.kv_format import KVBlockHandle, KVFormat
from bucketserve.kv_transfer.transport import TransferError
from bucketserve.kv_worker.rank_kv import RankKV, kv_format_of
from bucketserve.kv_worker.worker_env import accelerator_ids, apply_torch_threads, node_id
from bucketserve.runtime.distributed.tp_group import TPGroup, backend_for
from bucketserve.runtime.worker.device import Device
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from bucketserve.runtime.worker.tensor_parallel.tp_rank import RunnerFactory
from bucketserve.runtime.worker.tensor_parallel.tp_runner import (
    RankDeadError,
    TensorParallelRunner,
)

_GROUP_IDS = itertools.count()


class RankActor:
    """One rank other than the head: its shard of the model and of the KV pool. Ray runs
    its calls one at a time in the order the head sends them, so it runs every forward
    the head runs and meets it in the same collectives. Its KV shard moves to or from the
    peer worker's rank of the same index through its own transport (`RankKV`, `kv_call`)."""

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
        make_runner: RunnerFactory | None = None,
        worker: str = "",
    ) -> None:
        apply_torch_threads(torch_threads)
        if config.device.startswith("cuda"):  # the one card Ray gave this actor
            config = config.model_copy(update={"device": "cuda:0"})
            torch.cuda.set_device(0)
        store = dist.TCPStore(host, port, size, is_master=False)
        tp = TPGroup.create(backend, store, rank, size, group, timeout_s)
        self.runner = (make_runner or ModelRunner)(config, tp=tp)
        self.kv = RankKV(worker, rank, self.runner)

    def call(self, method: str, args: tuple) -> None:
        if method == "step_logits":  # ships this rank's KV of a batch begun for the step
            hook = self.kv.step_hook()
            if hook is not None:
                args = (*args, hook)
        getattr(self.runner, method)(*args)

    def kv_call(self, method: str, args: tuple) -> Any:
        return getattr(self.kv, method)(*args)

    def info(self) -> dict:
        return {
            "pid": os.getpid(),
            "node_id": node_id(),
            "accelerator_ids": accelerator_ids(),
            "kv_format": self.kv.format,
        }


class RayTensorParallelRunner(TensorParallelRunner):
    """`TensorParallelRunner` whose other ranks are RankActors (rank r in bundle r of
    `options["placement_group"]`, with the rest of `options`) instead of child processes;
    the group rendezvouses on a TCPStore at this node's address. A rank actor is owned by
    this process: it goes when the worker goes, and a dead one fails the next step.

    In a P->D handoff each rank ships (`begin_send` before the step, `finish_sends` after)
    or receives (`receive_shards`) its own KV shard; `kv_formats` are the ranks' pools."""

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
            config = config.model_copy(update={"device": "cuda:0"})
        host = ray.util.get_node_ip_address()
        group = f"tp-{name}-{os.getpid()}-{next(_GROUP_IDS)}"
        store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False)
        opts = {k: v for k, v in options.items() if k != "placement_group"}
        pg = options.get("placement_group")
        self.ranks = []  # the base class's processes: none here
        self.actors: list[Any] = []
        self._last: list[Any] = []
        self._timeout_s = timeout_s
        self._batch_keys = itertools.count()
        self._tp: TPGroup | None = None
        for rank in range(1, size):
            if pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=self._bundle_index(rank)
                )
            actor = (
                ray.remote(RankActor)
                .options(name=f"{group}-rank{rank}", max_restarts=0, max_task_retries=0, **opts)
                .remote(config, rank, size, backend, host, store.port, group, timeout_s,
                        torch_threads, self._rank_runner(), name)
            )  # fmt: skip
            self.actors.append(actor)
        self._store = store
        try:
            tp = TPGroup.create(backend, store, 0, size, group, timeout_s)
            self._tp = tp
            self._init_head(config, tp)
            self.rank_infos: list[dict] = ray.get(
                [a.info.remote() for a in self.actors], timeout=timeout_s
            )
        except BaseException:
            self.shutdown()
            raise

    def _bundle_index(self, rank: int) -> int:
        """Rank r's bundle of the placement group (a pipeline stage's ranks sit after the
        stages before it)."""
        return rank

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

    # -- the P->D handoff --------------------------------------------------------------------

    @property
    def kv_formats(self) -> list[KVFormat]:
        """Each rank's pool format, rank 0's (this one's) first."""
        return [kv_format_of(self), *(info["kv_format"] for info in self.rank_infos)]

    def begin_send(self, handle: KVBlockHandle, blocks: list[int]) -> int:
        """Each other rank ships the next step's K/V of `blocks` to `handle`'s rank of its
        index; the batch's key for `finish_sends` / `drop_sends`."""
        key = next(self._batch_keys)
        for rank, actor in enumerate(self.actors, 1):
            actor.kv_call.remote("begin_send", (key, handle.for_rank(rank), blocks))
        return key

    def finish_sends(self, key: int) -> list[Any]:
        """The other ranks' payloads of batch `key`, rank 1 first (on failure every rank
        drops the batch)."""
        try:
            return self.wait([a.kv_call.remote("finish", (key,)) for a in self.actors])
        except BaseException:
            self.drop_sends(key, "close")
            raise

    def drop_sends(self, key: int, how: str) -> None:
        """`how` is "abort" (never finished) or "close" (acknowledged); not waited for."""
        for actor in self.actors:
            actor.kv_call.remote(how, (key,))

    def receive_shards(
        self, handle: KVBlockHandle, payloads: list[Any], blocks: list[int]
    ) -> list[Any]:
        """Rank r takes `payloads[r - 1]` into `blocks`; `wait` for the returned calls."""
        return [
            actor.kv_call.remote("receive", (handle.for_rank(rank), payload, blocks))
            for rank, (actor, payload) in enumerate(zip(self.actors, payloads, strict=True), 1)
        ]

    def connect_ranks(
        self, backend: str, host: str, port: int, pairs: list[PairSpec], timeout_s: float
    ) -> list[Any]:
        """Each rank forms its collective groups with the peers' ranks of its index (under a
        prefix of its own in each pair's); `wait` for the returned calls."""
        return [
            actor.kv_call.remote("connect", (backend, host, port, [
                dataclasses.replace(p, prefix=f"{p.prefix}rank{rank}/") for p in pairs
            ], timeout_s))
            for rank, actor in enumerate(self.actors, 1)
        ]  # fmt: skip

    def wait(self, refs: list[Any]) -> list[Any]:
        """The results of calls to the ranks: RankDeadError if a rank is gone, TransferError
        if one failed or did not answer in time."""
        import ray

        try:
            return ray.get(refs, timeout=self._timeout_s)
        except ray.exceptions.RayTaskError as exc:
            raise TransferError(f"a tensor-parallel rank failed: {exc.cause!r}") from exc
        except ray.exceptions.GetTimeoutError as exc:
            raise TransferError(
                f"a tensor-parallel rank did not answer in {self._timeout_s:g} s"
            ) from exc
        except ray.exceptions.RayError as exc:
            raise RankDeadError(f"a tensor-parallel rank is gone: {exc!r}") from exc

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self._tp is not None:
            self._tp.close()
            self._tp = None
