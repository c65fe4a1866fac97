"""1 prefill + 1 decode worker (local mode) in graphs mode: every bucket compiled at warm-up,
the in-process engine's tokens, nothing compiled while serving batches that fit."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import pytest
from torch._dynamo.utils import counters

from bucketserve.bucket_manager.config import BucketRange, DecodeShapeConfig, PromptShapeConfig
from bucketserve.controller.controller import Controller
from bucketserve.gateway.metrics import _service_metrics
from tests.disagg.helpers import controller_config, serve_and_drain, small_batches

PROMPT_ROWS = BucketRange(4, 4, 4, 1)
# One decode bucket: 16 rows (the whole workload), 384 blocks in all (16 rows of its longest,
# 84 tokens, take 336): every decode batch fits it.
DECODE = DecodeShapeConfig(bs=BucketRange(16, 16, 16, 1), blocks=BucketRange(384, 128, 384, 1))


def few_buckets(prompt_rows: BucketRange = PROMPT_ROWS):
    """Prompt buckets of `prompt_rows` x query 64 (a prefill batch holds at most 4 of the
    workload's prompts, each under 64 tokens) and the decode bucket: every batch fits a
    bucket, and warm-up compiles no more (a cold inductor cache takes seconds a shape)."""
    buckets = small_batches(4)
    prompt = PromptShapeConfig(
        bs=prompt_rows, query=BucketRange(64, 64, 64, 1), ctx=BucketRange(0, 1, 0, 1)
    )
    shapes = buckets.shape_buckets.model_copy(update={"prompt": prompt, "decode": DECODE})
    return dataclasses.replace(buckets, shape_buckets=shapes)


@pytest.mark.slow
def test_graphs_mode_1p1d_matches_the_engine(
    tiny_model_dir: Path, work: list, reference: list, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="bucketserve.kv_worker.kv_worker")
    config = controller_config(tiny_model_dir, mode="local", buckets=few_buckets())
    runner = config.runner.model_copy(update={"execution": "graphs"})
    config = config.model_copy(update={"runner": runner})

    async def main() -> None:
        controller = Controller(config)
        await controller.start()
        infos = controller.pool.infos
        assert infos["prefill-0"]["execution"] == "graphs" and infos["prefill-0"]["padding"]
        assert [tuple(s) for s in infos["prefill-0"]["shapes"]] == [(4, 64, 16)]
        assert [tuple(s) for s in infos["decode-0"]["shapes"]] == [(16, 1, 384)]
        warmed = counters["stats"]["unique_graphs"]
        outputs, stats = await serve_and_drain(controller, work, "graphs")
        assert outputs == reference
        assert counters["stats"]["unique_graphs"] == warmed  # nothing compiled while serving
        for w in stats.workers:
            assert (w.execution, w.graph_misses, w.kv_export) == ("graphs", 0, "per_layer")
            assert w.graphs == 1 and w.graph_compile_s > 0
        text = "\n".join(str(m) for m in _service_metrics(stats))
        assert "bucketserve:graph_compile_seconds" in text

    asyncio.run(main())
    assert "prefill-0: [warm-up][prompt][1/1]" in caplog.text
    assert "decode-0: warmed 1 of 1 decode shapes" in caplog.text


@pytest.mark.slow
def test_colocated_graphs_mode_compiles_prompt_and_decode_buckets_at_warmup(
    tiny_model_dir: Path, work: list, reference: list, caplog: pytest.LogCaptureFixture
) -> None:
    """The colocated worker prefills too, so its warm-up compiles the prompt buckets beside
    the decode ones; its engine then serves the burst (all 16 prompts in one step: up to 8
    rows of one query level, each padded to 4 or 16 rows) without compiling anything."""
    caplog.set_level(logging.INFO, logger="bucketserve.kv_worker.kv_worker")
    buckets = few_buckets(prompt_rows=BucketRange(4, 4, 16, 2))
    config = controller_config(tiny_model_dir, mode="local", topology="colocated", buckets=buckets)
    runner = config.runner.model_copy(update={"execution": "graphs"})
    config = config.model_copy(update={"runner": runner})

    async def main() -> None:
        controller = Controller(config)
        await controller.start()
        shapes = controller.pool.infos["decode-0"]["shapes"]
        assert [tuple(s) for s in shapes] == [(4, 64, 16), (16, 64, 16), (16, 1, 384)]
        warmed = counters["stats"]["unique_graphs"]
        outputs, stats = await serve_and_drain(controller, work, "colocated-graphs")
        assert outputs == reference
        assert counters["stats"]["unique_graphs"] == warmed  # nothing compiled while serving
        (worker,) = stats.workers
        assert (worker.execution, worker.graph_misses, worker.graphs) == ("graphs", 0, 3)

    asyncio.run(main())
    assert "decode-0: [warm-up][prompt][2/2]" in caplog.text
    assert "decode-0: warmed 1 of 1 decode shapes" in caplog.text
