"""Checks that an aborted request stopped on its decode worker long before it could have
finished: the worker's steps are slowed so a request left running would take seconds, and
the steps the worker took from the request's start to the drain are counted (one output
per step), which no wall clock decides."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.gateway.conftest import fresh_stats, wait_until_idle

STEP_DELAY_S = 0.05  # added to every decode step: 200 tokens take 10 s


def slow_decode_steps(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode step of `backend`'s in-process decode workers waits STEP_DELAY_S first
    (outside the engine's lock: an abort lands meanwhile)."""
    for handle in backend.pool.role("decode"):
        engine = handle.worker.engine
        step = engine.step

        def slow(step: Any = step) -> Any:
            time.sleep(STEP_DELAY_S)
            return step()

        monkeypatch.setattr(engine, "step", slow)


def decode_steps(loop_thread: Any, backend: Any) -> int:
    """Steps the decode workers have taken that produced outputs, so far."""
    return sum(w.batches for w in fresh_stats(loop_thread, backend).workers if w.role == "decode")


def assert_stopped_early(
    loop_thread: Any, backend: Any, steps_before: int, max_tokens: int
) -> None:
    """After the drain: every block free, no lease open, no decode scheduler holding a
    request, and the decode workers took fewer than half of the steps the request would have
    taken to its `max_tokens` (an abort that did nothing computes them all)."""
    stats = wait_until_idle(loop_thread, backend, timeout=60)
    assert stats.kv_blocks_leaked == 0 and stats.leases_open == 0
    decode = [w for w in stats.workers if w.role == "decode"]
    assert [(w.running, w.waiting) for w in decode] == [(0, 0)] * len(decode)
    steps = sum(w.batches for w in decode) - steps_before
    assert steps < max_tokens // 2, (
        f"the decode worker took {steps} steps for a request aborted early "
        f"(max_tokens {max_tokens}): the abort did not stop it"
    )
