"""The controller's view of one worker: awaitable calls, liveness, restart, fault drills."""

from __future__ import annotations

import asyncio
import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from bucketserve.messages import WorkerStats

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """The worker process (or its in-process stand-in after `kill`) is gone mid-call."""


class WorkerHungError(WorkerDiedError):
    """The worker did not answer a call in time: it is declared dead and restarted."""


_UNTIMED = frozenset({"warmup"})  # warm-up compiles every shape bucket: minutes, legitimately


@dataclass
class Failure:
    """A call that raised: the Controller's fault policy judges whether `handle` died."""

    handle: WorkerHandle
    error: BaseException
    epoch: int


class WorkerHandle(ABC):
    """Calls a worker's methods from the controller's event loop.

    `epoch` counts deaths: work started in an older epoch belongs to a worker
    life that is over, whatever its reply says.
    """

    def __init__(self, name: str, role: str) -> None:
        self.name = name
        self.role = role
        self.alive = False
        self.epoch = 0
        self.restarts = 0
        self.stats: WorkerStats | None = None
        self.boot_id = ""
        self.inflight = 0  # prefill batches sent and not answered
        # decode: blocks being reserved, not in `stats` yet; prefill: blocks of batches
        # dispatched and not yet released
        self.pending_blocks = 0
        self.reviving: asyncio.Task | None = None
        self.timeout_s: float | None = None  # a call unanswered this long: the worker hangs

    async def call(self, method: str, *args: Any) -> Any:
        if self.timeout_s is None or method in _UNTIMED:
            return await self._call(method, *args)
        try:
            # asyncio.timeout, not wait_for: wait_for runs the call as a task of its own,
            # and Python 3.11's can hang when cancelled as that task finishes (shutdown)
            async with asyncio.timeout(self.timeout_s):
                return await self._call(method, *args)
        except TimeoutError:
            raise WorkerHungError(
                f"{self.name} did not answer {method} within {self.timeout_s:g} s "
                "(controller.worker_timeout_s); declared hung"
            ) from None

    @abstractmethod
    async def _call(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    async def start(self) -> None:
        """Create (or wait for) the worker and warm it up."""

    @abstractmethod
    async def kill(self) -> None:
        """Fault drill: the worker dies as if its process crashed."""

    @abstractmethod
    async def stop(self) -> None: ...

    async def warm_up(self) -> dict:
        report = await self.call("warmup")
        info = await self.call("info")
        self.boot_id = info["boot_id"]
        self.stats = await self.call("stats")
        self.alive = True
        return {**report, **info}

    def mark_dead(self) -> bool:
        """Record a death once; False if it was already recorded."""
        if not self.alive:
            return False
        self.alive = False
        self.epoch += 1
        self.inflight = 0
        self.pending_blocks = 0
        if self.stats is not None:
            self.stats.alive = False
        return True

    @property
    def load(self) -> int:
        """Sequences running or waiting at the last report."""
        return (self.stats.running + self.stats.waiting) if self.stats else 0

    @property
    def free_blocks(self) -> int:
        """Blocks the controller may still plan with on this worker."""
        if self.stats is None:
            return 0
        if self.role == "prefill":
            return max(0, self.stats.num_total_blocks - self.pending_blocks)
        taken = self.stats.blocks_to_come + self.pending_blocks
        return max(0, self.stats.num_free_blocks - taken)


class LocalWorkerHandle(WorkerHandle):
    """A worker object in this process; its calls run on the handle's own threads.

    `kill` shuts the object down and makes every call, including those still
    running, fail with WorkerDiedError; `start` then builds a fresh one, as
    Ray restarts an actor.
    """

    def __init__(self, name: str, role: str, factory: Callable[[], Any], threads: int) -> None:
        super().__init__(name, role)
        self.factory = factory
        self.worker: Any = None
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._life = 0

    async def _call(self, method: str, *args: Any) -> Any:
        worker, life = self.worker, self._life
        if worker is None:
            raise WorkerDiedError(f"{self.name} is not running")
        loop = asyncio.get_running_loop()
        call = functools.partial(getattr(worker, method), *args)
        result = await loop.run_in_executor(self._pool, call)
        if life != self._life:
            raise WorkerDiedError(f"{self.name} died during {method}")
        return result

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.worker = await loop.run_in_executor(self._pool, self.factory)
        self._life += 1

    async def kill(self) -> None:
        worker, self.worker = self.worker, None
        self._life += 1
        if worker is not None:
            await asyncio.get_running_loop().run_in_executor(self._pool, worker.shutdown)

    async def stop(self) -> None:
        await self.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)


class RayWorkerHandle(WorkerHandle):
    """A Ray actor (restartable: Ray brings it back after a crash, `max_task_retries=0`
    so the call that crashed it is not re-run behind our back)."""

    def __init__(self, name: str, role: str, actor: Any) -> None:
        super().__init__(name, role)
        self.actor = actor

    async def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return await getattr(self.actor, method).remote(*args)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise WorkerDiedError(f"{self.name} died during {method}: {exc}") from exc

    async def start(self, timeout_s: float = 600.0) -> None:
        """Wait until the (re)started actor answers (calls queue while Ray restarts it;
        one that keeps failing is dead for good)."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + timeout_s, 0.1
        while True:
            try:
                await self.call("ping")
                return
            except WorkerDiedError:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=False)

    async def stop(self) -> None:
        import ray

        try:
            await asyncio.wait_for(self.call("shutdown"), timeout=10)
        except Exception as exc:  # it may be dead already
            logger.info("%s: shutdown call failed: %s", self.name, exc)
        ray.kill(self.actor, no_restart=True)
