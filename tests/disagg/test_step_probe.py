"""Workers that compute prompts price them from a warm-up probe, so the controller's TTFT
forecast (and `shed: predicted`) has figures before the first request; the probe runs on
dummy rows and leaves no trace in the served counters or the pool."""

from __future__ import annotations

from pathlib import Path

from bucketserve.decode_worker.config import DecodeWorkerConfig
from bucketserve.decode_worker.decode_worker import DecodeWorker
from bucketserve.prefill_worker.config import PrefillWorkerConfig
from bucketserve.prefill_worker.prefill_worker import PrefillWorker
from bucketserve.runtime.engine.engine_config import EngineConfig
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from tests.disagg.helpers import BLOCK_SIZE


def runner(model_dir: Path) -> ModelRunnerConfig:
    return ModelRunnerConfig(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64)


def test_a_decode_worker_that_prefills_has_step_prices_after_warm_up(tiny_model_dir: Path) -> None:
    for prefills in (True, False):
        engine = EngineConfig(runner=runner(tiny_model_dir))
        worker = DecodeWorker(DecodeWorkerConfig(engine=engine, prefills=prefills))
        try:
            before = worker.stats()
            assert before.prefill_token_s is None and before.decode_step_s is None
            worker.warmup()
            after = worker.stats()
            if prefills:
                assert after.prefill_token_s > 0 and after.decode_step_s > 0
            else:  # a disaggregated worker's prompts are priced on the prefill side
                assert after.prefill_token_s is None
            assert after.batches == 0 and after.num_free_blocks == after.num_total_blocks
        finally:
            worker.shutdown()


def test_a_prefill_worker_has_its_token_price_after_warm_up(tiny_model_dir: Path) -> None:
    worker = PrefillWorker(PrefillWorkerConfig(runner=runner(tiny_model_dir)))
    try:
        assert worker.stats().prefill_token_s is None
        worker.warmup()
        stats = worker.stats()
        assert stats.prefill_token_s > 0
        assert stats.batches == 0 and stats.num_free_blocks == stats.num_total_blocks
    finally:
        worker.shutdown()
