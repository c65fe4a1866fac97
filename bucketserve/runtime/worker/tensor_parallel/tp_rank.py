"""A tensor-parallel rank other than the head: a process that builds its shard of the model
and KV pool, then runs each step the head rank sends it (the same forward, no sampling)."""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from bucketserve.runtime.distributed.tp_group import TPGroup
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

logger = logging.getLogger(__name__)

STOP = "stop"

# what a rank builds over its end of the group (a ModelRunner, or one pipeline stage's)
RunnerFactory = Callable[..., ModelRunner]


def serve_rank(runner: ModelRunner, conn: Connection) -> None:
    """Run the head rank's calls in order until it says stop or its end of the pipe closes.
    An error ends the rank (its group's collectives then fail on the head rank too)."""
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        kind, args = message
        if kind == STOP:
            return
        getattr(runner, kind)(*args)


def rank_main(
    config: ModelRunnerConfig,
    rank: int,
    size: int,
    backend: str,
    store_port: int,
    group_name: str,
    timeout_s: float,
    torch_threads: int | None,
    conn: Connection,
    make_runner: RunnerFactory | None = None,
) -> None:
    """The entry of a spawned rank process; `make_runner(config, tp=...)` builds its
    runner (None: a ModelRunner)."""
    if torch_threads:
        torch.set_num_threads(torch_threads)
    if config.device.startswith("cuda:"):  # NCCL binds the group to the current card
        torch.cuda.set_device(torch.device(config.device))
    try:
        store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False)
        tp = TPGroup.create(backend, store, rank, size, group_name, timeout_s)
        runner = (make_runner or ModelRunner)(config, tp=tp)
        conn.send(("ready", os.getpid()))
        serve_rank(runner, conn)
    except Exception:
        _report(conn, traceback.format_exc())
        raise
    finally:
        conn.close()


def _report(conn: Connection, text: str) -> Any:
    try:
        conn.send(("error", text))
    except (OSError, ValueError):
        logger.error("tensor-parallel rank failed: %s", text)
