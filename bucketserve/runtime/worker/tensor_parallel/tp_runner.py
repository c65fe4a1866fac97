"""The head rank of a tensor-parallel group: a ModelRunner holding rank 0's shard that
starts the other ranks as processes and sends each of them every step before running it."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.distributed.tp_group import TPGroup, backend_for
from bucketserve.runtime.worker.device import Device
from bucketserve.runtime.worker.model_runner import (
    LayerHook,
    ModelRunner,
    Shape,
)
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from bucketserve.runtime.worker.step_inputs import UnifiedShape
from bucketserve.runtime.worker.tensor_parallel.step_seq import StepSeq
from bucketserve.runtime.worker.tensor_parallel.tp_rank import STOP, RunnerFactory, rank_main

_GROUP_IDS = itertools.count()


class RankDeadError(RuntimeError):
    """A rank of the group is gone: the group cannot run another step (its worker is
    restarted with every rank)."""


@dataclass
class RankProcess:
    rank: int
    process: Any
    conn: Connection


class TensorParallelRunner(ModelRunner):
    """`ModelRunner` over `size` ranks: this one (rank 0, the head: its block manager and
    scheduler are the engine's) and `size - 1` processes started with multiprocessing's
    spawn, as vLLM's multiprocessing executor does. Every call that runs the model
    (`step_logits`, `compute_logits`, `warmup`) is first sent to the other ranks (the
    step's sequences as `StepSeq`s, pickled over a pipe), so all run the same forward and
    meet in the same collectives; only the head samples. `torch_threads`: intra-op
    threads of each spawned rank (default: this machine's cores shared out)."""

    def __init__(
        self,
        config: ModelRunnerConfig,
        size: int,
        torch_threads: int | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if size < 2:
            raise ValueError(f"a tensor-parallel group needs >= 2 ranks, got {size}")
        device_type = Device(config.device).type
        backend = backend_for(device_type)
        if device_type == "cuda":  # rank r on card r
            config = config.model_copy(update={"device": "cuda:0"})
        threads = torch_threads or max(1, (os.cpu_count() or 1) // size)
        name = f"tp-{os.getpid()}-{next(_GROUP_IDS)}"
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.ranks: list[RankProcess] = []
        self._finalizer = weakref.finalize(self, _stop, self.ranks, None)
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            rank_config = config
            if device_type == "cuda":
                rank_config = config.model_copy(update={"device": f"cuda:{rank}"})
            args = (rank_config, rank, size, backend, store.port, name, timeout_s, threads, child,
                    self._rank_runner())  # fmt: skip
            process = ctx.Process(target=rank_main, args=args, daemon=True, name=f"{name}-{rank}")
            process.start()
            child.close()
            self.ranks.append(RankProcess(rank, process, parent))
        tp = TPGroup.create(backend, store, 0, size, name, timeout_s)
        self._store = store
        try:
            self._init_head(config, tp)
            self._wait_ready(timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._finalizer = weakref.finalize(self, _stop, self.ranks, tp)

    def _init_head(self, config: ModelRunnerConfig, tp: TPGroup) -> None:
        """Build this rank's runner over its end of the group (a pipeline stage's head
        builds its stage's)."""
        ModelRunner.__init__(self, config, tp)

    def _rank_runner(self) -> RunnerFactory | None:
        """What each other rank builds over its end (None: a ModelRunner)."""
        return None

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.ranks) + 1

    @property
    def rank_pids(self) -> list[int]:
        return [r.process.pid for r in self.ranks]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for r in self.ranks:
            if not r.conn.poll(max(0.0, deadline - time.monotonic())):
                raise RankDeadError(f"tensor-parallel rank {r.rank} did not start in {timeout_s}s")
            kind, detail = r.conn.recv()
            if kind != "ready":
                raise RankDeadError(f"tensor-parallel rank {r.rank} failed to start:\n{detail}")

    def alive(self) -> bool:
        return all(r.process.is_alive() for r in self.ranks)

    def _send(self, method: str, *args: Any) -> None:
        for r in self.ranks:
            try:
                r.conn.send((method, args))
            except (OSError, ValueError) as exc:
                raise RankDeadError(f"tensor-parallel rank {r.rank} is gone: {exc!r}") from exc

    @torch.inference_mode()
    def step_logits(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: Shape | UnifiedShape | None = None,
        on_layer: LayerHook | None = None,
    ) -> torch.Tensor:
        self._send("step_logits", [StepSeq(s) for s in seqs], list(num_new_tokens), pad_to)
        return super().step_logits(seqs, num_new_tokens, pad_to, on_layer)

    @torch.inference_mode()
    def compute_logits(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_to: Shape | UnifiedShape | None = None,
    ) -> torch.Tensor:
        self._send("compute_logits", [StepSeq(s) for s in seqs], list(num_new_tokens), pad_to)
        return super().compute_logits(seqs, num_new_tokens, pad_to)

    @torch.inference_mode()
    def warmup(
        self, shapes: Iterable[Shape | UnifiedShape]
    ) -> dict[Shape | UnifiedShape, float]:
        shapes = [self.inputs.check_shape(s) for s in shapes]
        self._send("warmup", shapes)
        return super().warmup(shapes)

    def shutdown(self) -> None:
        """Stop the other ranks (and wait for them) and leave the group."""
        self._finalizer()


def _stop(ranks: list[RankProcess], tp: TPGroup | None) -> None:
    for r in ranks:
        with contextlib.suppress(OSError, ValueError):
            r.conn.send((STOP, ()))
    for r in ranks:
        r.process.join(timeout=30)
        if r.process.is_alive():
            r.process.kill()
            r.process.join(timeout=10)
        r.conn.close()
    if tp is not None:
        tp.close()
