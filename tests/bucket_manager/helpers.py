"""Helpers for the bucket manager tests: a manager from a few knobs, a request factory."""

from __future__ import annotations

from bucketserve.bucket_manager import (
    BatchingConfig,
    BucketManager,
    BucketManagerConfig,
    BucketRange,
    BucketRequest,
    PromptShapeConfig,
    RequestBucketConfig,
    ShapeBucketConfig,
    TenantConfig,
)


def make_manager(
    *tenants: TenantConfig,
    max_num_seqs: int = 256,
    max_len: int = 1024,
    snap: float = 0.0,
    count_output_tokens: bool = True,
    max_batched_tokens: int | None = 8192,
    padded: bool = True,
    fit_batch_buckets: bool = True,
) -> BucketManager:
    """Doc shape buckets (block 128, length 1024) with prompt batch sizes 1, 2, 4."""
    shapes = ShapeBucketConfig(prompt=PromptShapeConfig(bs=BucketRange(1, 2, 4, 3)))
    return BucketManager(
        BucketManagerConfig(
            request_buckets=RequestBucketConfig(max_len=max_len, shape_edge_snap=snap),
            shape_buckets=shapes,
            batching=BatchingConfig(
                max_num_seqs=max_num_seqs,
                count_output_tokens=count_output_tokens,
                max_batched_tokens=max_batched_tokens,
                fit_batch_buckets=fit_batch_buckets,
            ),
            tenants=tenants or (TenantConfig(name="default"),),
        ),
        padded=padded,
    )


def req(request_id, prompt_len, arrival=0.0, tenant="default", **kw) -> BucketRequest:
    return BucketRequest(request_id, prompt_len, tenant=tenant, arrival_time=arrival, **kw)


def ids(batch) -> list:
    return [r.request_id for r in batch.requests]
