"""The soak's faults: a worker process SIGKILLed, or SIGSTOPped (hung) and later SIGCONTed,
and how long the service took to serve again after each (a probe request completes, and a
killed worker's actor has a new process). Worker processes: `worker_processes`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bucketserve import AsyncClient, SamplingParams
from bucketserve.gateway.retry_policy import RetryPolicy

PROBE = SamplingParams(temperature=0, max_tokens=2)


@dataclass
class Fault:
    """One fault and its recovery, seconds from the start of the soak."""

    kind: str  # "sigkill" | "sigstop"
    at_s: float
    worker: str
    pid: int
    held_s: float = 0.0  # sigstop: how long it stayed stopped
    recovered_s: float | None = None  # from the fault until a probe completed (None: never)
    new_pid: int | None = None  # sigkill: the actor's next process
    probe_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class FaultDrill:
    """Fires faults at worker processes found by `workers` (a {pid: title} source) and
    measures recovery by probing `grpc_target`."""

    grpc_target: str
    workers: Callable[[], dict[int, str]]  # e.g. worker_processes, or ServeProcess.workers
    started: float
    api_key: str | None = None
    stop_s: float = 15.0  # SIGCONT after this long; 0: never (the service must notice)
    recover_timeout_s: float = 600.0
    faults: list[Fault] = field(default_factory=list)
    stopped: set[int] = field(default_factory=set)
    _turn: int = 0

    async def wait_for_workers(self, timeout_s: float = 600.0, exclude: frozenset = frozenset()
                               ) -> dict[int, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = {p: t for p, t in self.workers().items() if p not in exclude}
            if found:
                return found
            await asyncio.sleep(0.5)
        return {}

    def _pick(self) -> tuple[int, str] | None:
        """Worker processes in turn, skipping stopped ones."""
        found = sorted((p, t) for p, t in self.workers().items() if p not in self.stopped)
        if not found:
            return None
        self._turn += 1
        return found[self._turn % len(found)]

    async def kill(self) -> Fault | None:
        picked = self._pick()
        if picked is None:
            return None
        pid, title = picked
        fault = Fault("sigkill", time.monotonic() - self.started, title, pid)
        self.faults.append(fault)
        os.kill(pid, signal.SIGKILL)
        begun = time.monotonic()
        fresh = await self.wait_for_workers(self.recover_timeout_s, frozenset({pid}))
        fault.new_pid = next((p for p, t in fresh.items() if t == title), None)
        await self._probe(fault, begun)
        return fault

    async def stop(self) -> Fault | None:
        picked = self._pick()
        if picked is None:
            return None
        pid, title = picked
        fault = Fault("sigstop", time.monotonic() - self.started, title, pid)
        self.faults.append(fault)
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(pid)
        begun = time.monotonic()
        if self.stop_s > 0:
            await asyncio.sleep(self.stop_s)
            self.resume(pid)
            fault.held_s = time.monotonic() - begun
        await self._probe(fault, begun)
        return fault

    def resume(self, pid: int | None = None) -> None:
        """SIGCONT to `pid`, or to every process this drill stopped."""
        for target in [pid] if pid is not None else sorted(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGCONT)
            self.stopped.discard(target)

    async def _probe(self, fault: Fault, begun: float) -> None:
        """Probe requests until one completes: the recovery time, counted from `begun`."""
        deadline = begun + self.recover_timeout_s
        async with AsyncClient(
            self.grpc_target, api_key=self.api_key or "", retry=RetryPolicy(max_attempts=1)
        ) as client:
            while time.monotonic() < deadline:
                try:
                    done = await client.generate(
                        "Hi", PROBE, timeout=max(1.0, deadline - time.monotonic())
                    )
                    if done.finish_reason in ("stop", "length"):
                        fault.recovered_s = time.monotonic() - begun
                        return
                    fault.probe_error = f"{done.finish_reason}: {done.error}"
                except Exception as exc:  # the service may refuse while a worker is down
                    fault.probe_error = repr(exc)[:200]
                await asyncio.sleep(0.5)
