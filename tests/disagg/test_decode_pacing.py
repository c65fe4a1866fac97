"""Decode pacing: steps wait under the running requests' TPOT targets while a prefill batch
for the worker is in flight, and only then (bucketserve.decode_worker.pacer)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from bucketserve.controller.config import ControllerConfig
from bucketserve.decode_worker.config import DecodeWorkerConfig
from bucketserve.decode_worker.decode_worker import DecodeWorker
from bucketserve.decode_worker.pacer import DecodePacer
from bucketserve.deploy.serve_config import ServeConfig
from bucketserve.deploy.serve_config_error import ServeConfigError
from bucketserve.messages import ServeRequest, WorkerRequest
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.engine.engine_config import EngineConfig
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from tests.disagg.helpers import BLOCK_SIZE


def decoding(tpot: float | None, last: float | None, uncomputed: int = 1) -> Sequence:
    seq = Sequence([1, 2, 3, 4], tpot_target=tpot)
    seq.num_computed_tokens = len(seq) - uncomputed
    seq.metrics.last_token_time = last
    return seq


def test_the_step_waits_for_the_sequence_closest_to_its_target() -> None:
    pacer = DecodePacer(0.8)
    running = [decoding(0.25, 10.0), decoding(0.5, 10.1)]
    # due: min(10.0 + 0.2, 10.1 + 0.4) = 10.2; the step (0.05 s) starts by 10.15
    assert pacer.hold_s(running, 0, now=10.05, step_s=0.05) == pytest.approx(0.1)
    assert pacer.hold_s(running, 0, now=10.15, step_s=0.05) == pytest.approx(0.0)
    assert pacer.hold_s(running, 0, now=10.3, step_s=0.05) == 0.0  # late: run now


@pytest.mark.parametrize(
    "odd",
    [
        decoding(None, 10.0),  # no TPOT target
        decoding(0.25, None),  # admitted, its first token not out from here yet
        decoding(0.25, 10.0, uncomputed=5),  # recomputing after a preemption
    ],
)
def test_nothing_waits_for_a_sequence_pacing_cannot_judge(odd: Sequence) -> None:
    pacer = DecodePacer(0.8)
    assert pacer.hold_s([decoding(0.25, 10.0)], 0, now=10.0, step_s=0.0) > 0
    assert pacer.hold_s([decoding(0.25, 10.0), odd], 0, now=10.0, step_s=0.0) == 0.0


def test_nothing_waits_with_a_sequence_waiting_or_none_running() -> None:
    pacer = DecodePacer(0.8)
    assert pacer.hold_s([decoding(0.25, 10.0)], 1, now=10.0, step_s=0.0) == 0.0
    assert pacer.hold_s([], 0, now=10.0, step_s=0.0) == 0.0


@pytest.mark.parametrize("pace", [0, 1.5, True, "0.8"])
def test_a_pace_outside_0_1_is_refused_with_what_to_set(pace: object) -> None:
    data = {"controller": {"topology": "disaggregated", "decode": {"pace": pace}}}
    with pytest.raises(
        ServeConfigError, match=r"controller\.decode\.pace: must be a number in \(0, 1\] or null"
    ):
        ServeConfig.from_dict(data)
    with pytest.raises(ValueError, match=r"pace\n  Input should be"):
        DecodeWorkerConfig(pace=pace)


def test_the_colocated_topology_refuses_decode_pace() -> None:
    with pytest.raises(ValueError, match=r"colocated topology has none .* 'disaggregated'"):
        ControllerConfig(topology="colocated", decode={"pace": 0.8})


TPOT = 0.3
TOKENS = 6


def decode_worker(model_dir: Path, pace: float | None) -> DecodeWorker:
    runner = ModelRunnerConfig(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64)
    return DecodeWorker(
        DecodeWorkerConfig(engine=EngineConfig(runner=runner), transport="inprocess", pace=pace)
    )


def greedy(tpot_s: float) -> WorkerRequest:
    """A greedy request of TOKENS tokens with TPOT target `tpot_s`, which the worker's
    own engine prefills (the colocated entry: no prefill worker needed)."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    return WorkerRequest(ServeRequest("r", [5, 6, 7, 8, 9], params), [], tpot_s=tpot_s)


def run_one(model_dir: Path, pace: float | None) -> tuple[list[int], list[float], float]:
    """One greedy request on a decode worker while a lease stands for a prefill batch in
    flight: its tokens, their arrival times, paced seconds."""
    worker = decode_worker(model_dir, pace)
    try:
        lease = worker.reserve([("in-flight", 2)]).lease_id
        assert worker.admit_prompts([greedy(TPOT)]).admitted == ["r"]
        tokens: list[int] = []
        times: list[float] = []
        deadline = time.monotonic() + 30
        while len(tokens) < TOKENS and time.monotonic() < deadline:
            for step in worker.next_outputs(timeout_s=0.5):
                for delta in step.deltas:
                    tokens += delta.token_ids
                    times += [step.time] * len(delta.token_ids)
        worker.release(lease)
        return tokens, times, worker.stats().paced_s
    finally:
        worker.shutdown()


def test_a_paced_worker_spaces_tokens_to_the_target_and_keeps_them(tiny_model_dir: Path) -> None:
    tokens, times, paced = run_one(tiny_model_dir, pace=1.0)
    free_tokens, free_times, free_paced = run_one(tiny_model_dir, pace=None)
    assert tokens == free_tokens and len(tokens) == TOKENS
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # each token waits until about TPOT after the last (less a step of the tiny model)
    assert min(gaps) > 0.7 * TPOT, gaps
    assert paced > 0.5 * TPOT * (TOKENS - 1) and free_paced == 0.0
    assert free_times[-1] - free_times[0] < times[-1] - times[0]


def test_without_a_prefill_in_flight_nothing_waits(tiny_model_dir: Path) -> None:
    worker = decode_worker(tiny_model_dir, pace=1.0)
    try:
        assert worker.admit_prompts([greedy(60.0)]).admitted == ["r"]
        got = 0
        deadline = time.monotonic() + 30  # paced, 60 s a token: far past this
        while got < TOKENS and time.monotonic() < deadline:
            got += sum(len(d.token_ids) for s in worker.next_outputs(0.5) for d in s.deltas)
        assert got == TOKENS and worker.stats().paced_s == 0.0
    finally:
        worker.shutdown()
