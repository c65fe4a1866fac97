"""Request buckets, shape buckets, tenant policies and memory-safe batching (torch-free).

"Eq. N" and "Algorithm 1" are [BucketServe]'s, "[Bucketing]" is vllm-gaudi's bucketing document:
docs/references.md maps each to the function that implements it."""

from bucketserve.bucket_manager.adaptive_buckets import AdaptiveBuckets
from bucketserve.bucket_manager.batching_controller import BatchingController
from bucketserve.bucket_manager.bucket_file import BucketFileError, BucketFileParser
from bucketserve.bucket_manager.bucket_manager import BucketManager
from bucketserve.bucket_manager.config import (
    BUCKET_FILE_ENV,
    BatchingConfig,
    BucketManagerConfig,
    BucketRange,
    DecodeShapeConfig,
    PromptShapeConfig,
    RequestBucketConfig,
    ShapeBucketConfig,
    TenantConfig,
)
from bucketserve.bucket_manager.monitor import BucketMetrics
from bucketserve.bucket_manager.policy import Policy
from bucketserve.bucket_manager.prefill_batch import PrefillBatch
from bucketserve.bucket_manager.request import BucketRequest
from bucketserve.bucket_manager.shape_buckets import PaddedShape, ShapeBuckets

__all__ = [
    "BUCKET_FILE_ENV",
    "AdaptiveBuckets",
    "BatchingConfig",
    "BatchingController",
    "BucketFileError",
    "BucketFileParser",
    "BucketManager",
    "BucketManagerConfig",
    "BucketMetrics",
    "BucketRange",
    "BucketRequest",
    "DecodeShapeConfig",
    "PaddedShape",
    "Policy",
    "PrefillBatch",
    "PromptShapeConfig",
    "RequestBucketConfig",
    "ShapeBucketConfig",
    "ShapeBuckets",
    "TenantConfig",
]
