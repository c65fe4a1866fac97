import logging

import pytest

from bucketserve.bucket_manager import (
    BUCKET_FILE_ENV,
    BucketRange,
    DecodeShapeConfig,
    PromptShapeConfig,
    ShapeBucketConfig,
    ShapeBuckets,
)
from bucketserve.bucket_manager.bucket_range import exponential_range, linear_range

# The bucketing doc's start-up log, verbatim after the "INFO ... [file:line] " prefix.
DOC_PROMPT_CONFIG = (
    "Prompt bucket config (min, step, max_warmup, limit) bs:[1, 1, 1, 1], seq:[128, 128, 1024, 11]"
)
DOC_PROMPT = (
    "Generated 36 prompt buckets [bs, query, num_blocks]: [(1, 128, 0), (1, 128, 1), (1, 128, 2), "
    "(1, 128, 3), (1, 128, 4), (1, 128, 5), (1, 128, 6), (1, 128, 7), (1, 256, 0), (1, 256, 1), "
    "(1, 256, 2), (1, 256, 3), (1, 256, 4), (1, 256, 5), (1, 256, 6), (1, 384, 0), (1, 384, 1), "
    "(1, 384, 2), (1, 384, 3), (1, 384, 4), (1, 384, 5), (1, 512, 0), (1, 512, 1), (1, 512, 2), "
    "(1, 512, 3), (1, 512, 4), (1, 640, 0), (1, 640, 1), (1, 640, 2), (1, 640, 3), (1, 768, 0), "
    "(1, 768, 1), (1, 768, 2), (1, 896, 0), (1, 896, 1), (1, 1024, 0)]"
)
DOC_DECODE = (
    "Generated 42 decode buckets [bs, query, num_blocks]: [(1, 1, 128), (1, 1, 256), (1, 1, 384), "
    "(1, 1, 512), (1, 1, 640), (1, 1, 768), (1, 1, 896), (1, 1, 1024), (1, 1, 1408), (1, 1, 1792), "
    "(1, 1, 2432), (1, 1, 3328), (1, 1, 4352), (1, 1, 5888), (2, 1, 128), (2, 1, 256), "
    "(2, 1, 384), "
    "(2, 1, 512), (2, 1, 640), (2, 1, 768), (2, 1, 896), (2, 1, 1024), (2, 1, 1408), (2, 1, 1792), "
    "(2, 1, 2432), (2, 1, 3328), (2, 1, 4352), (2, 1, 5888), (4, 1, 128), (4, 1, 256), "
    "(4, 1, 384), "
    "(4, 1, 512), (4, 1, 640), (4, 1, 768), (4, 1, 896), (4, 1, 1024), (4, 1, 1408), (4, 1, 1792), "
    "(4, 1, 2432), (4, 1, 3328), (4, 1, 4352), (4, 1, 5888)]"
)
DOC_BLOCKS = [128, 256, 384, 512, 640, 768, 896, 1024, 1408, 1792, 2432, 3328, 4352, 5888]


def doc_config(**prompt) -> ShapeBucketConfig:
    """The doc's configuration: block size 128, max model length 1024."""
    return ShapeBucketConfig(prompt=PromptShapeConfig(**prompt))


def test_doc_default_generates_the_36_prompt_and_42_decode_buckets():
    shapes = ShapeBuckets(doc_config(), log=False)
    assert len(shapes.prompt) == 36
    assert len(shapes.decode) == 42
    assert shapes.prompt[:9] == [(1, 128, c) for c in range(8)] + [(1, 256, 0)]
    assert shapes.decode[13:15] == [(1, 1, 5888), (2, 1, 128)]
    assert [n for _, _, n in shapes.decode[:14]] == DOC_BLOCKS


def test_startup_log_matches_the_doc_format(caplog):
    with caplog.at_level(logging.INFO, logger="bucketserve.bucket_manager.shape_buckets"):
        ShapeBuckets(doc_config())
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == DOC_PROMPT_CONFIG
    assert lines[1] == (
        "Decode bucket config (min, step, max_warmup, limit) bs:[1, 2, 4, 3], "
        "block:[128, 128, 5888, 14]"
    )
    assert lines[2:] == [DOC_PROMPT, DOC_DECODE]


def test_exponential_reference_dimensions():
    assert exponential_range(BucketRange(128, 128, 1024, 11)) == [128 * i for i in range(1, 9)]
    assert exponential_range(BucketRange(128, 128, 5888, 14)) == DOC_BLOCKS
    assert exponential_range(BucketRange(1, 2, 4, 3)) == [1, 2, 4]
    assert exponential_range(BucketRange(1, 1, 1, 1)) == [1]
    # the doc's plotted example: dense at the small end, sparse toward max
    assert exponential_range(BucketRange(128, 128, 4096, 13)) == [
        128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1664, 2304, 3072, 4096
    ]
    # min and max are kept even when they are not multiples of step
    assert exponential_range(BucketRange(3, 4, 30, 4)) == [3, 8, 12, 30]
    assert exponential_range(BucketRange(0, 2, 8, 4)) == [0, 2, 4, 8]


def test_linear_doc_examples_with_and_without_ramp_up():
    assert linear_range(BucketRange(2, 32, 64)) == [2, 4, 8, 16, 32, 64]
    assert linear_range(BucketRange(128, 128, 512)) == [128, 256, 384, 512]
    assert linear_range(BucketRange(0, 4, 12)) == [0, 4, 8, 12]
    assert linear_range(BucketRange(1, 32, 100)) == [1, 2, 4, 8, 16, 32, 64, 96, 100]


def test_linear_strategy_grid_filters_prompts_to_the_model_length():
    config = ShapeBucketConfig(
        strategy="linear",
        block_size=128,
        max_model_len=512,
        prompt=PromptShapeConfig(
            bs=BucketRange(1, 2, 2), query=BucketRange(128, 128, 512), ctx=BucketRange(0, 2, 2)
        ),
        decode=DecodeShapeConfig(bs=BucketRange(2, 32, 8), blocks=BucketRange(128, 128, 256)),
    )
    shapes = ShapeBuckets(config, log=False)
    per_bs = [(128, 0), (128, 2), (256, 0), (256, 2), (384, 0), (512, 0)]
    assert shapes.prompt == [(b, q, c) for b in (1, 2) for q, c in per_bs]
    assert shapes.decode == [(b, 1, n) for b in (2, 4, 8) for n in (128, 256)]
    assert ShapeBuckets(config, log=False).describe()[0] == (
        "Prompt bucket config (min, step, max_warmup) bs:[1, 2, 2], seq:[128, 128, 512]"
    )


def test_padding_follows_the_doc_example():
    shapes = ShapeBuckets(doc_config(bs=BucketRange(1, 2, 4, 3)), log=False)
    # 3 sequences of up to 412 tokens: batch padded to 4, length to 512
    assert shapes.pad_prompt(3, 412) == ((4, 512, 0), False)
    assert shapes.pad_decode(3, 500) == ((4, 1, 512), False)
    assert shapes.pad_decode(2, 512) == ((2, 1, 512), False)  # a request finished
    assert shapes.pad_decode(4, 513) == ((4, 1, 640), False)  # the context grew
    assert shapes.pad_prompt(1, 128, 7) == ((1, 128, 7), False)
    assert shapes.pad_prompt(1, 129, 6) == ((1, 256, 6), False)
    assert shapes.graph_misses == 0


def test_beyond_the_largest_bucket_runs_unpadded_and_counts_a_graph_miss(caplog):
    shapes = ShapeBuckets(doc_config(), log=False)
    with caplog.at_level(logging.WARNING, logger="bucketserve.bucket_manager.shape_buckets"):
        assert shapes.pad_prompt(2, 100) == ((2, 100, 0), True)  # bs 2 was never warmed
        assert shapes.pad_prompt(1, 900, 1) == ((1, 900, 1), True)  # 1024 + 128 > model length
        assert shapes.pad_decode(8, 100) == ((8, 1, 100), True)
    assert shapes.graph_misses == 3
    assert len([r for r in caplog.records if "graph miss" in r.getMessage()]) == 3


def test_pad_rejects_nonsense_shapes():
    shapes = ShapeBuckets(doc_config(), log=False)
    with pytest.raises(ValueError, match="prompt batch_size must be an integer >= 1"):
        shapes.pad_prompt(0, 10)
    with pytest.raises(ValueError, match="decode blocks must be an integer >= 0"):
        shapes.pad_decode(1, -1)
    assert shapes.graph_misses == 0


def test_query_edges_are_the_warmed_prompt_lengths():
    shapes = ShapeBuckets(doc_config(), log=False)
    assert shapes.query_edges == [128, 256, 384, 512, 640, 768, 896, 1024]


def test_file_strategy_reads_the_config_path_or_the_env_var(tmp_path, monkeypatch):
    path = tmp_path / "buckets.txt"
    path.write_text("(1, 2048, 0)\n(64, 1, 1024)\n")
    monkeypatch.delenv(BUCKET_FILE_ENV, raising=False)
    with pytest.raises(ValueError, match=BUCKET_FILE_ENV):
        ShapeBucketConfig(strategy="file")
    shapes = ShapeBuckets(ShapeBucketConfig(strategy="file", file=str(path)), log=False)
    assert (shapes.prompt, shapes.decode) == ([(1, 2048, 0)], [(64, 1, 1024)])
    monkeypatch.setenv(BUCKET_FILE_ENV, str(path))
    shapes = ShapeBuckets(ShapeBucketConfig(strategy="file"), log=False)
    assert shapes.describe()[0] == f"Bucket file: {path}"
    assert shapes.pad_prompt(1, 1500) == ((1, 2048, 0), False)
    # the env var only names a file; it never switches the strategy
    assert len(ShapeBuckets(ShapeBucketConfig(), log=False).prompt) == 36


def test_sparse_file_buckets_pad_to_the_least_volume_fit(tmp_path):
    path = tmp_path / "sparse.txt"
    path.write_text("(1, 256, 0)\n(4, 128, 0)\n(2, 512, 0)\n(8, 1, [16, 64])\n")
    shapes = ShapeBuckets(ShapeBucketConfig(strategy="file", file=str(path)), log=False)
    assert shapes.pad_prompt(2, 200) == ((2, 512, 0), False)  # (2, 256, 0) is not warmed
    assert shapes.pad_prompt(1, 100) == ((1, 256, 0), False)  # 256 < 4 x 128
    assert shapes.pad_prompt(3, 100) == ((4, 128, 0), False)
    assert shapes.pad_prompt(3, 300) == ((3, 300, 0), True)
    assert shapes.pad_decode(5, 17) == ((8, 1, 64), False)
    assert shapes.graph_misses == 1
