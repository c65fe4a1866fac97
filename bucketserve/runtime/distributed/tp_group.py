"""A tensor-parallel group: the ranks of one worker, formed without torch.distributed's
default group (a process may hold several runners: a TP 1 one beside a TP 2 head), gloo on
CPU, NCCL on CUDA, HCCL on Gaudi."""

from __future__ import annotations

import contextlib
import datetime
import importlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = {"cuda": "nccl", "hpu": "hccl", "cpu": "gloo"}
# HCCL lives outside torch and registers itself when this module is imported
_PLUGIN_MODULES = {"hccl": "habana_frameworks.torch.distributed.hccl"}
_GROUPS: dict[str, TPGroup] = {}  # by name: what the custom ops below find a group by
_BUILDING: list[TPGroup | None] = [None]  # the group layers built now shard for


def backend_for(device_type: str) -> str:
    if device_type not in BACKENDS:
        raise ValueError(
            f"no tensor-parallel backend for device {device_type!r}; known: {BACKENDS}"
        )
    return BACKENDS[device_type]


class TPGroup:
    """This rank's end of a worker's tensor-parallel group (`rank` of `size`).

    `all_reduce` sums a tensor over the ranks (in place outside a compiled region; inside
    one, as the `bucketserve::tp_all_reduce` custom op, so inductor keeps it as one opaque
    call); `all_gather` concatenates each rank's tensor along the last dimension."""

    def __init__(self, name: str, rank: int, size: int, group: Any) -> None:
        self.name, self.rank, self.size = name, rank, size
        self.group = group
        _GROUPS[name] = self

    @classmethod
    def create(
        cls,
        backend: str,
        store: Any,
        rank: int,
        size: int,
        name: str,
        timeout_s: float,
    ) -> TPGroup:
        """Rendezvous on `store` (under `name`) with the other `size - 1` ranks."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.PrefixStore(name, store)
        if backend == "gloo":
            group = dist.ProcessGroupGloo(store, rank, size, timeout)
        elif backend == "nccl":
            group = dist.ProcessGroupNCCL(store, rank, size)
        else:
            group = _plugin_group(backend, store, rank, size, timeout, name)
        return cls(name, rank, size, group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.bucketserve.tp_all_reduce(x, self.name)
        self.group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.bucketserve.tp_all_gather(x, self.name)
        return self._gather(x)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x`, in place (a pipeline stage's head hands its
        input hidden states to the stage's other ranks)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([x], options).wait()
        return x

    def min_int(self, value: int) -> int:
        """The least of every rank's `value` (each rank's KV pool must hold the same
        number of blocks: the head rank's block manager hands out ids for all)."""
        t = torch.tensor([value], dtype=torch.int64)
        self.group.allreduce([t], _min_options()).wait()
        return int(t.item())

    def close(self) -> None:
        _GROUPS.pop(self.name, None)
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            with contextlib.suppress(Exception):
                shutdown()


def _min_options() -> Any:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    return options


def _plugin_group(
    backend: str, store: Any, rank: int, size: int, timeout: datetime.timedelta, name: str
) -> Any:
    """A group of a backend registered through `Backend.register_backend` (HCCL), built with
    its creator directly: `init_process_group` would claim the process's default group."""
    module = _PLUGIN_MODULES.get(backend)
    if module is not None:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise RuntimeError(
                f"tensor parallelism over {backend} needs {module} (Intel Gaudi's PyTorch "
                "packages) on this node"
            ) from exc
    plugin = dist.Backend._plugins.get(backend.upper())
    if plugin is None:
        raise RuntimeError(f"torch.distributed has no {backend!r} backend registered")
    if not plugin.extended_api:
        return plugin.creator_fn(store, rank, size, timeout)
    options = dist.distributed_c10d._DistributedBackendOptions()
    options.store, options.group_rank, options.group_size = store, rank, size
    options.timeout, options.group_id = timeout, name
    options.global_ranks_in_group = list(range(size))
    return plugin.creator_fn(options, None)


@contextlib.contextmanager
def building(group: TPGroup | None) -> Iterator[None]:
    """Layers constructed inside shard themselves for `group` (None: unsharded)."""
    _BUILDING.append(group)
    try:
        yield
    finally:
        _BUILDING.pop()


def current() -> TPGroup | None:
    """The group the layers built now shard for; None (or a group of one): no sharding."""
    group = _BUILDING[-1]
    return group if group is not None and group.size > 1 else None


@torch.library.custom_op("bucketserve::tp_all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group: str) -> torch.Tensor:
    out = x.clone()
    _GROUPS[group].group.allreduce([out]).wait()
    return out


@_all_reduce_op.register_fake
def _(x, group):
    return torch.empty_like(x)


@torch.library.custom_op("bucketserve::tp_all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, group: str) -> torch.Tensor:
    return _GROUPS[group]._gather(x)


@_all_gather_op.register_fake
def _(x, group):
    size = _GROUPS[group].size
    return x.new_empty((*x.shape[:-1], x.shape[-1] * size))
