"""A batch handed to prefill: its requests, their KV need in blocks and its padded shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic

from bucketserve.bucket_manager.bucket_file import ShapeBucket
from bucketserve.bucket_manager.policy import OrderKey
from bucketserve.bucket_manager.request import BucketRequest, T


@dataclass(frozen=True)
class PrefillBatch(Generic[T]):
    """`kv_blocks_per_request[i]` is what the decode pool must reserve for `requests[i]`.

    `shape` is the warmed prompt bucket the batch pads to, or its own unpadded
    shape on a graph miss: (rows, query tokens to compute, context blocks of the cached
    prefix expected). `order_keys` let the manager re-queue the batch
    exactly where its requests were.
    """

    batch_id: int
    tenant: str
    requests: tuple[BucketRequest[T], ...]
    bucket: tuple[int, int]
    shape: ShapeBucket
    graph_miss: bool
    kv_blocks_per_request: tuple[int, ...]
    block_size: int
    waste_ratio: float  # Eq. 2: padding to the longest length to compute
    padded_waste: float  # Eq. 2 against the padded query length
    shape_waste: float  # padding share of the whole padded shape, batch rows included
    padded_tokens: int  # tokens the forward computes, padding included (unpadded: its own)
    order_keys: tuple[OrderKey, ...] = field(repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def kv_blocks(self) -> int:
        return sum(self.kv_blocks_per_request)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the prefill computes: those not expected in a prefix cache."""
        return sum(r.effective_len for r in self.requests)

    @property
    def max_prompt_len(self) -> int:
        return max(r.prompt_len for r in self.requests)
