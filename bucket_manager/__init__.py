"""Request buckets, shape buckets, tenant policies and memory-safe batching (torch-free)."""

from bucket_manager.adaptive_buckets import AdaptiveBuckets
from bucket_manager.batching_controller import BatchingController
from bucket_manager.bucket_file import BucketFileError, BucketFileParser
from bucket_manager.bucket_manager import BucketManager
from bucket_manager.config import (
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
from bucket_manager.monitor import BucketMetrics
from bucket_manager.policy import Policy, TenantClass
from bucket_manager.prefill_batch import PrefillBatch
from bucket_manager.request import BucketRequest
from bucket_manager.shape_buckets import PaddedShape, ShapeBuckets

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
    "TenantClass",
    "TenantConfig",
]
