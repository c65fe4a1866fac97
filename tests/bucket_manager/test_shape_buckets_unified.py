"""The unified strategy (the bucketing doc's alpha version): (query, shared blocks, unique
blocks, is_causal) buckets at the whole, half and quarter of max_num_seqs and of
max_num_batched_tokens (and of the blocks), plus 0 blocks; a step's need; its padding."""

import logging

import pytest

from bucketserve.bucket_manager import ShapeBucketConfig, ShapeBuckets
from bucketserve.bucket_manager.bucket_range import alpha_range
from bucketserve.bucket_manager.unified_buckets import unified_need, unified_ranges
from bucketserve.cli import main

# the doc's unified start-up log: 375 buckets, its first two and last
DOC_HEAD = "Generated 375 unified buckets [query, shared_blocks, unique_blocks]: [(8, 0, 0, 1), "
DOC_SECOND, DOC_LAST = (8, 0, 8, 0), (2048, 256, 5781, 1)
# its warm-up log's buckets 2-4 (query_len 2048, shared_blocks 256, causal)
DOC_WARMED = [(2048, 256, 2890, 1), (2048, 256, 1445, 1), (2048, 256, 32, 1)]


def unified(**overrides) -> ShapeBuckets:
    return ShapeBuckets(ShapeBucketConfig(strategy="unified", **overrides), log=False)


def test_the_defaults_give_the_docs_375_unified_buckets():
    """The doc's log comes from 32 sequences, 2048 batched tokens, 1024-token rows of
    128-token blocks and a 5781-block pool: the defaults."""
    shapes = unified()
    assert len(shapes.unified) == 375 and len(set(shapes.unified)) == 375
    assert shapes.unified[:2] == [(8, 0, 0, 1), DOC_SECOND] and shapes.unified[-1] == DOC_LAST
    assert all(b in shapes.unified for b in DOC_WARMED)
    assert unified_ranges(shapes.config) == (
        [8, 16, 32, 512, 1024, 2048],  # max_num_seqs 32 and 2048 tokens: whole, 1/2, 1/4
        [0, 8, 16, 32, 64, 128, 256],  # 0, 32 sequences, 32 rows of 1024 // 128 blocks
        [0, 8, 16, 32, 1445, 2890, 5781],  # 0, 32 sequences, the pool
    )
    line = next(x for x in shapes.describe() if x.startswith("Generated 375 unified"))
    assert line.startswith(DOC_HEAD) and line.endswith(f"{DOC_LAST}]")
    assert line == "Generated 375 unified buckets [query, shared_blocks, unique_blocks]: " + str(
        shapes.unified
    )


def test_the_docs_example_config_of_64_sequences_and_4096_tokens():
    q, shared, unique = unified_ranges(
        ShapeBucketConfig(strategy="unified", max_num_seqs=64, max_num_batched_tokens=4096)
    )
    assert q == [16, 32, 64, 1024, 2048, 4096]
    assert shared == [0, 16, 32, 64, 128, 256, 512] and unique == [0, 16, 32, 64, 1445, 2890, 5781]


def test_a_small_config_by_hand():
    """2 sequences, 8 batched tokens, 8-token rows of 4-token blocks, a 4-block pool.
    query: 1, 2 (of 2; its quarter is 0, no query) and 2, 4, 8; shared blocks: 0 and 1, 2
    and of 2 rows x 2 blocks (4, at most the pool) 1, 2, 4; unique: the same of the pool.
    Causal: one 1-token query has one row, so at most 8 // 4 = 2 shared blocks; more
    tokens, 2 rows: 4. Decode only: 1 token a row, at most 2 tokens; some context; a shared
    block needs two readers (none for one token) and 2 tokens leave each row 2 blocks."""
    shapes = unified(
        max_num_seqs=2, max_num_batched_tokens=8, block_size=4, max_model_len=8, num_blocks=4
    )
    blocks = (0, 1, 2, 4)
    assert unified_ranges(shapes.config) == ([1, 2, 4, 8], list(blocks), list(blocks))
    causal = {(1, s, u, 1) for s in (0, 1, 2) for u in blocks}
    causal |= {(q, s, u, 1) for q in (2, 4, 8) for s in blocks for u in blocks}
    decode = {(q, 0, u, 0) for q in (1, 2) for u in (1, 2, 4)}
    decode |= {(2, s, u, 0) for s in (1, 2) for u in blocks}
    assert shapes.unified == sorted(causal | decode) and len(shapes.unified) == 74


def test_alpha_range_points():
    assert alpha_range(64, 4096) == [16, 32, 64, 1024, 2048, 4096]
    assert alpha_range(3, 3) == [1, 3]  # 3 // 4 == 0 is no query length; duplicates once
    assert alpha_range(3, 3, zero=True) == [0, 1, 3]


def test_a_steps_need_counts_shared_and_unique_context_blocks():
    block = 4
    # a prompt chunk after 6 computed tokens: its 2 context blocks are read by its 3 tokens
    assert unified_need([[7, 8, 9]], [6], [3], block) == (3, 2, 0, 1)
    # a fresh prompt has no context; a decode row after 9 tokens reads its 3 blocks alone
    assert unified_need([[1, 2], [3, 4, 5]], [0, 9], [5, 1], block) == (6, 0, 3, 1)
    # two decode rows holding the same 2 cached prefix blocks, then 1 block each of their own
    assert unified_need([[1, 2, 3], [1, 2, 4]], [10, 11], [1, 1], block) == (2, 2, 2, 0)
    # the partial block a row is writing counts as context when it holds earlier tokens
    assert unified_need([[5, 6]], [5], [1], block) == (1, 0, 2, 0)
    assert unified_need([], [], [], block) == (0, 0, 0, 0)


def test_padding_to_the_smallest_unified_bucket(caplog):
    shapes = unified()
    assert shapes.pad_unified((5, 0, 3, 1)) == ((8, 0, 8, 1), False)
    assert shapes.pad_unified((20, 3, 40, 0)) == ((32, 8, 1445, 0), False)
    assert shapes.pad_unified((300, 100, 9, 1)) == ((512, 128, 16, 1), False)
    # decode rows alone beyond max_num_seqs: no decode bucket holds them, a causal one does
    assert shapes.pad_unified((40, 0, 40, 0)) == ((512, 0, 1445, 1), False)
    # a step with a prompt chunk never takes a decode bucket
    assert all(shapes.pad_unified((q, 0, 8, 1)).shape[3] == 1 for q in (1, 8, 32))
    with caplog.at_level(logging.WARNING):
        assert shapes.pad_unified((4096, 0, 0, 1)) == ((4096, 0, 0, 1), True)
    assert shapes.graph_misses == 1 and "exceeds every warmed unified bucket" in caplog.text
    with pytest.raises(ValueError, match="unified is_causal"):
        shapes.pad_unified((1, 0, 0, -1))
    with pytest.raises(ValueError, match="no unified buckets"):
        ShapeBuckets(log=False).pad_unified((1, 0, 1, 0))


def test_unified_keeps_prompt_and_decode_buckets_for_prefill_batches(caplog):
    """Prefill workers and request-bucket edges still use (batch, query, blocks) shapes,
    spaced as the exponential strategy spaces them."""
    with caplog.at_level(logging.INFO):
        shapes = ShapeBuckets(ShapeBucketConfig(strategy="unified"))
    exponential = ShapeBuckets(log=False)
    assert (shapes.prompt, shapes.decode) == (exponential.prompt, exponential.decode)
    assert exponential.unified == []
    assert DOC_HEAD in caplog.text and "Generated 36 prompt buckets" in caplog.text


def test_config_keys_and_sizing_for_an_engine():
    cfg = ShapeBucketConfig.from_dict(
        {"strategy": "unified", "max_num_seqs": 4, "max_num_batched_tokens": 64, "num_blocks": 9}
    )
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.num_blocks) == (4, 64, 9)
    sized = cfg.for_engine(8, 128, 100)
    assert (sized.max_num_seqs, sized.max_num_batched_tokens, sized.num_blocks) == (8, 128, 100)
    plain = ShapeBucketConfig()
    assert plain.for_engine(8, 128, 100) is plain  # the other strategies read none of them
    with pytest.raises(ValueError, match="num_blocks"):
        ShapeBucketConfig(strategy="unified", num_blocks=0)
    with pytest.raises(ValueError, match="limit: is required"):
        ShapeBucketConfig.from_dict({"strategy": "unified", "decode": {"bs": [1, 1, 4]}})


def test_cli_prints_the_unified_buckets(tmp_path, capsys):
    assert main(["buckets", "--strategy", "unified"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Unified bucket config")
    assert lines[1].startswith(DOC_HEAD) and lines[1].endswith(f"{DOC_LAST}]")
    flags = ["--max-num-seqs", "2", "--max-num-batched-tokens", "8", "--num-blocks", "4"]
    args = ["buckets", "--strategy", "unified", "--block-size", "4", "--max-model-len", "8"]
    assert main(args + flags) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("Generated 74 unified buckets")
    # a service YAML: the decode engine's limits and the pool's size
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: {max_model_len: 8}\n"
        "kv_cache: {block_size: 4, num_blocks: 4}\n"
        "controller: {decode: {max_num_seqs: 2, max_num_batched_tokens: 8}}\n"
        "buckets: {strategy: unified}\n"
    )
    assert main(["buckets", "--config", str(config)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "Unified bucket config (max_num_seqs, max_num_batched_tokens, num_blocks) [2, 8, 4] "
        "query:[1, 2, 4, 8], shared_blocks:[0, 1, 2, 4], unique_blocks:[0, 1, 2, 4]"
    )
    # the engine's own defaults (64 sequences, 2048 tokens) where the YAML names none
    config.write_text("model: {max_model_len: 8}\nbuckets: {strategy: unified}\n")
    assert main(["buckets", "--config", str(config)]) == 0
    out = capsys.readouterr()
    assert "[64, 2048, 5781] query:[16, 32, 64, 512, 1024, 2048]" in out.out.splitlines()[0]
    assert "a decode worker sizes them for its engine's limits and its own KV pool" in out.err


def test_the_service_config_accepts_the_unified_strategy():
    from bucketserve.deploy.serve_config import ServeConfig
    from bucketserve.deploy.serve_settings import ServeSettings

    config = ServeConfig.from_settings(ServeSettings.parse({"buckets": {"strategy": "unified"}}))
    assert config.shape_buckets == {"strategy": "unified"}
    shapes = config.controller_config(max_len=1024).buckets.shape_buckets
    assert shapes.strategy == "unified"
