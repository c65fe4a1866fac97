"""Process-level setup both worker kinds share: threads, node id, padding, warm-up choice."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def resolve_padding(setting: str | bool, device_type: str) -> bool:
    """`auto`: pad where fixed-shape graphs exist (hpu, cuda); the CPU runner is varlen."""
    return device_type != "cpu" if setting == "auto" else bool(setting)


def warmup_selection(mode: str, padding: bool, shapes: Sequence[T]) -> list[T]:
    """The shapes to warm: `auto` is all of them when padding, else only the smallest (with
    no padding the served shapes are not the buckets, so warming them all buys nothing)."""
    if mode == "none" or not shapes:
        return []
    if mode == "all" or (mode == "auto" and padding):
        return list(shapes)
    return [shapes[0]]


# libgomp's own spin count when OMP_WAIT_POLICY is unset (local mode runs with it)
SPIN_COUNT = 300_000


def omp_env(threads: int, spins: bool) -> dict[str, str]:
    """OpenMP settings of a worker with `threads` intra-op threads. A pool that `spins`
    (`ControllerConfig.omp_spins`) does so between ops for libgomp's own default count, then
    sleeps; the others wait passively (a spinning pool steals the cores it shares).
    Spinning without a limit starves the gateway; a short spin puts the threads to sleep
    between the ops of a decode step, and waking them costs more than the step's short ops.
    `OMP_WAIT_POLICY` / `GOMP_SPINCOUNT` in the environment win."""
    wait = os.environ.get("OMP_WAIT_POLICY") or ("active" if spins else "passive")
    env = {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": wait}
    if wait.lower() == "active":
        env["GOMP_SPINCOUNT"] = os.environ.get("GOMP_SPINCOUNT", str(SPIN_COUNT))
    return env


def pin_cpus(cpus: list[int] | None) -> None:
    """Keep this process (and the threads it starts from now on) on `cpus`."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def apply_torch_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def node_id() -> str:
    """The Ray node this process runs on, or `local` outside Ray."""
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return "local"
    if not ray.is_initialized():
        return "local"
    return ray.get_runtime_context().get_node_id()


def accelerator_ids() -> dict[str, list[str]]:
    """The accelerator ids (GPU, HPU, ...) Ray assigned this actor; empty outside Ray."""
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return {}
    if not ray.is_initialized():
        return {}
    ids = ray.get_runtime_context().get_accelerator_ids()
    return {kind: list(v) for kind, v in ids.items() if v}


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor (a local-mode worker is the service's process)."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def new_boot_id() -> str:
    """Tells a restarted worker from its previous life (leases do not survive a restart)."""
    return uuid.uuid4().hex[:8]


def actor_restarted() -> bool | None:
    """Whether this process is a restarted life of a Ray actor (None: not a Ray actor)."""
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return None
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return None
    return bool(context.was_current_actor_reconstructed)
