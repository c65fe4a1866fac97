"""Two-rank process groups, one per prefill/decode pair, formed without the default group.

NCCL on CUDA, HCCL on Gaudi, gloo on CPU. Each pair rendezvouses on the
controller's TCPStore under its own prefix, so a restarted worker re-forms only
the pairs it belongs to and the survivors never re-initialise torch.distributed's
default group (which raises once it exists).
"""

from __future__ import annotations

import datetime
import importlib
from typing import Any

import torch.distributed as dist

BACKENDS = {"cuda": "nccl", "hpu": "hccl", "cpu": "gloo"}
# A backend living outside torch registers itself when its module is imported; Habana's
# must be imported before any HCCL group is formed.
BACKEND_MODULES = {"hccl": "habana_frameworks.torch.distributed.hccl"}
SENDER_RANK, RECEIVER_RANK = 0, 1  # in every pair: the prefill worker sends, the decode receives


def backend_for(device_type: str) -> str:
    if device_type not in BACKENDS:
        raise ValueError(f"no collective backend for device {device_type!r}; known: {BACKENDS}")
    return BACKENDS[device_type]


def import_backend(backend: str) -> None:
    """Import the module that registers `backend` with torch.distributed, if it has one."""
    module = BACKEND_MODULES.get(backend)
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(
            f"the {backend} KV transport needs {module}; install Intel Gaudi's PyTorch "
            "packages (habana-torch-plugin) on this node, or set controller.transport to ray"
        ) from exc


def pair_group(
    backend: str, host: str, port: int, prefix: str, rank: int, timeout_s: float
) -> Any:
    """This side's end of a two-rank group. Blocks until the peer joins (or `timeout_s`)."""
    import_backend(backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, 2, is_master=False, timeout=timeout)
    store = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, 2)
    return _plugin_group(backend, store, rank, timeout, prefix)


def _plugin_group(
    backend: str, store: Any, rank: int, timeout: datetime.timedelta, group_id: str
) -> Any:
    """A group of a backend registered through `Backend.register_backend` (HCCL), built with
    its creator directly: `init_process_group` would claim the process's default group."""
    plugins = dist.Backend._plugins
    plugin = plugins.get(backend.upper())
    if plugin is None:
        raise RuntimeError(
            f"torch.distributed has no {backend!r} backend registered; known plugins: "
            f"{sorted(plugins) or 'none'}"
        )
    if not plugin.extended_api:
        return plugin.creator_fn(store, rank, 2, timeout)
    options = dist.distributed_c10d._DistributedBackendOptions()
    options.store = store
    options.group_rank = rank
    options.group_size = 2
    options.timeout = timeout
    options.group_id = group_id
    options.global_ranks_in_group = [SENDER_RANK, RECEIVER_RANK]
    return plugin.creator_fn(options, None)
