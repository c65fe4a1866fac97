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

# the decode batch's blocks in all: 128 (one full 512-token sequence) and 384 (16 rows of
# the workload's longest, 84 tokens); a row holds at most 128, so (1|2, 1, 384) are not warmed
BUCKET_BLOCKS = BucketRange(128, 128, 384, 2)


def few_buckets():
    """3 prompt buckets (batch 1, 2, 4 x query 64) and 8 decode buckets (batch 1..16 x 128
    or 384 blocks in all): the workload's batches all fit, and warm-up stays short."""
    buckets = small_batches(4)
    shapes = dataclasses.replace(
        buckets.shape_buckets,
        prompt=PromptShapeConfig(
            bs=BucketRange(1, 1, 4, 3),
            query=BucketRange(64, 64, 64, 1),
            ctx=BucketRange(0, 1, 0, 1),
        ),
        decode=DecodeShapeConfig(bs=BucketRange(1, 1, 16, 5), blocks=BUCKET_BLOCKS),
    )
    return dataclasses.replace(buckets, shape_buckets=shapes)


@pytest.mark.slow
def test_graphs_mode_1p1d_matches_the_engine(
    tiny_model_dir: Path, work: list, reference: list, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="bucketserve.kv_worker.kv_worker")
    config = controller_config(tiny_model_dir, mode="local", buckets=few_buckets())
    config.runner = dataclasses.replace(config.runner, execution="graphs")

    async def main() -> None:
        controller = Controller(config)
        await controller.start()
        infos = controller.pool.infos
        assert infos["prefill-0"]["execution"] == "graphs" and infos["prefill-0"]["padding"]
        assert len(infos["prefill-0"]["shapes"]) == 3 and len(infos["decode-0"]["shapes"]) == 8
        warmed = counters["stats"]["unique_graphs"]
        outputs, stats = await serve_and_drain(controller, work, "graphs")
        assert outputs == reference
        assert counters["stats"]["unique_graphs"] == warmed  # nothing compiled while serving
        for w in stats.workers:
            assert (w.execution, w.graph_misses, w.kv_export) == ("graphs", 0, "per_layer")
            assert w.graphs == (3 if w.role == "prefill" else 8) and w.graph_compile_s > 0
        text = "\n".join(str(m) for m in _service_metrics(stats))
        assert "bucketserve:graph_compile_seconds" in text

    asyncio.run(main())
    assert "prefill-0: [warm-up][prompt][3/3]" in caplog.text
    assert "decode-0: warmed 8 of 8 decode shapes" in caplog.text


@pytest.mark.slow
def test_colocated_graphs_mode_compiles_prompt_and_decode_buckets_at_warmup(
    tiny_model_dir: Path, work: list, reference: list, caplog: pytest.LogCaptureFixture
) -> None:
    """The colocated worker prefills too, so its warm-up compiles the prompt buckets beside
    the decode ones; its engine then serves the burst (all 16 prompts in one step: up to 8
    rows of one query level) without compiling anything."""
    caplog.set_level(logging.INFO, logger="bucketserve.kv_worker.kv_worker")
    buckets = few_buckets()
    prompt = dataclasses.replace(buckets.shape_buckets.prompt, bs=BucketRange(1, 1, 16, 5))
    buckets = dataclasses.replace(
        buckets, shape_buckets=dataclasses.replace(buckets.shape_buckets, prompt=prompt)
    )
    config = controller_config(tiny_model_dir, mode="local", shape="colocated", buckets=buckets)
    config.runner = dataclasses.replace(config.runner, execution="graphs")

    async def main() -> None:
        controller = Controller(config)
        await controller.start()
        shapes = controller.pool.infos["decode-0"]["shapes"]
        assert [tuple(s) for s in shapes[:5]] == [(b, 64, 16) for b in (1, 2, 4, 8, 16)]
        assert len(shapes) == 5 + 8
        warmed = counters["stats"]["unique_graphs"]
        outputs, stats = await serve_and_drain(controller, work, "colocated-graphs")
        assert outputs == reference
        assert counters["stats"]["unique_graphs"] == warmed  # nothing compiled while serving
        (worker,) = stats.workers
        assert (worker.execution, worker.graph_misses, worker.graphs) == ("graphs", 0, 13)

    asyncio.run(main())
    assert "decode-0: [warm-up][prompt][5/5]" in caplog.text
    assert "decode-0: warmed 8 of 8 decode shapes" in caplog.text
