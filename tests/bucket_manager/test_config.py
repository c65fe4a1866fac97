import pytest

from bucketserve.bucket_manager import (
    BatchingConfig,
    BucketManagerConfig,
    BucketRange,
    PromptShapeConfig,
    RequestBucketConfig,
    ShapeBucketConfig,
    TenantConfig,
)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: ShapeBucketConfig.from_dict({"strategy": "cubic"}),
            "shape_buckets.strategy: must be one of 'exponential', 'linear', 'file', "
            "'unified', got 'cubic'",
        ),
        (
            lambda: ShapeBucketConfig(prompt=PromptShapeConfig(query=BucketRange(128, 128, 1024))),
            "prompt.query.limit: is required by the exponential strategy",
        ),
        (lambda: ShapeBucketConfig(block_size=0), r"block_size\n  Input should be greater than"),
        (lambda: PromptShapeConfig(bs=BucketRange(0, 1, 4)), "bs.min: must be >= 1, got 0"),
        (lambda: BucketRange(10, 1, 5), r"max: must be >= min \(10\), got 5"),
        (lambda: BucketRange(1, 0, 5), r"step\n  Input should be greater than or equal to 1"),
        (lambda: RequestBucketConfig(theta=1.5), r"theta\n  Input should be less than or equal"),
        (lambda: RequestBucketConfig(shape_edge_snap=0.6), r"shape_edge_snap\n  Input should be"),
        (lambda: RequestBucketConfig(max_len=True), r"max_len\n  Input should be a valid int"),
        (lambda: BatchingConfig(safety_fraction=0), r"safety_fraction\n  Input should be greater"),
        (lambda: BatchingConfig(max_num_seqs=0), r"max_num_seqs\n  Input should be greater"),
        (lambda: BatchingConfig(max_batched_tokens=0), r"max_batched_tokens\n  Input should be"),
        (lambda: BatchingConfig(fit_batch_buckets="yes"),
         r"fit_batch_buckets\n  Input should be a valid boolean"),
        (
            lambda: TenantConfig.parse({"name": "chat", "policy": "sjf"}, "tenants[0]"),
            r"^tenants\[0\]\.policy: online tenants are served by earliest arrival, so policy",
        ),
        (
            lambda: TenantConfig.parse({"name": "x", "class": "batch"}, "tenants[0]"),
            r"^tenants\[0\]\.class: must be one of 'online', 'offline', got 'batch'",
        ),
        (
            lambda: TenantConfig.parse({"name": "x", "class": "offline", "policy": "lifo"}, "t"),
            r"^t\.policy: must be one of 'fcfs', 'sjf', 'ljf', got 'lifo'",
        ),
        (lambda: TenantConfig.parse({"name": "x", "weight": 0}), r"^weight: must be a number > 0"),
        (lambda: TenantConfig(name="x", max_wait_s=-1.0), "max_wait_s\n.*greater than 0"),
        (lambda: TenantConfig(name=""), "name\n.*at least 1 character"),
        (
            lambda: BucketManagerConfig(tenants=(TenantConfig(name="a"), TenantConfig(name="a"))),
            r"duplicate tenant names \['a'\]",
        ),
        (lambda: BucketManagerConfig(tenants=()), "must name at least one tenant"),
    ],
)
def test_invalid_config_names_the_field_and_allowed_values(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_from_dict_builds_the_nested_shape_config():
    config = ShapeBucketConfig.from_dict(
        {
            "strategy": "linear",
            "max_model_len": 4096,
            "prompt": {"bs": [1, 2, 8], "query": {"min": 128, "step": 256, "max": 4096}},
            "decode": {"blocks": [16, 16, 512]},
        }
    )
    assert (config.strategy, config.max_model_len) == ("linear", 4096)
    assert config.prompt.bs == BucketRange(1, 2, 8)
    assert config.prompt.query == BucketRange(128, 256, 4096)
    assert config.decode.blocks == BucketRange(16, 16, 512)
    assert config.decode.bs == BucketRange(1, 2, 4, 3)  # default kept


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"prompts": {}}, r"shape_buckets\.prompts: unknown key 'prompts' \("),
        ({"prompt": {"query": [10, 1, 5, 3]}}, r"prompt\.query\.max: must be >= min \(10\)"),
        ({"prompt": {"query": [1, 2]}}, r"shape_buckets.prompt.query: must be \[min"),
        ({"prompt": {"qery": [1, 2, 4]}}, r"shape_buckets\.prompt\.qery: unknown key 'qery' \("),
        ({"decode": 5}, "shape_buckets.decode: must be a mapping, got an integer 5"),
    ],
)
def test_from_dict_rejects_unknown_keys_and_bad_values(data, message):
    with pytest.raises(ValueError, match=message):
        ShapeBucketConfig.from_dict(data)
