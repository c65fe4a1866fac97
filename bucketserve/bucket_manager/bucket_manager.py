"""The bucket manager: requests in, memory-safe prefill batches padded to warmed shapes out."""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Iterator
from typing import Generic, NamedTuple

from bucketserve.bucket_manager.adaptive_buckets import AdaptiveBuckets
from bucketserve.bucket_manager.batching_controller import BatchingController
from bucketserve.bucket_manager.config import BatchingConfig, BucketManagerConfig
from bucketserve.bucket_manager.monitor import BucketMetrics, BucketMonitor
from bucketserve.bucket_manager.policy import OrderKey
from bucketserve.bucket_manager.prefill_batch import PrefillBatch
from bucketserve.bucket_manager.request import BucketRequest, T
from bucketserve.bucket_manager.request_bucket import RequestBucket
from bucketserve.bucket_manager.shape_buckets import ShapeBuckets
from bucketserve.bucket_manager.tenant import Tenant
from bucketserve.bucket_manager.waste import padded_waste, waste_ratio
from bucketserve.utils.checks import check_int


class _Entry(NamedTuple):
    request: BucketRequest
    key: OrderKey


class BucketManager(Generic[T]):
    """Request buckets (Algorithm 1) per tenant policy, batched within the decode pool's room.

    A batch comes from one tenant and one request bucket. A request that has
    waited its tenant's `max_wait_s` is served first (aging), the earliest such
    arrival across tenants, whatever their priorities and fair shares: no tenant
    starves. Otherwise the tenant is the highest-priority one with queued
    requests and, among equals, the smallest fair share, and the bucket is the
    one holding the tenant's first request in policy order. Requests are taken
    in that order while their KV blocks fit 0.9 x the free blocks (Eq. 5-6)
    and the batch stays within `max_num_seqs`, `max_batched_tokens` and the
    largest warmed prompt batch size; the first that does not fit ends the
    batch, so nothing overtakes it. Padded, the batch then keeps the most of
    them that fill a warmed batch size (`BatchingConfig.fit_batch_buckets`).

    With a prefix cache, a request's length is what its prefill computes
    (`BucketRequest.effective_len`): buckets, policy order, the token budget,
    padding and fair shares count those tokens; KV blocks count the whole
    prompt, which the decode pool holds either way.

    `padded=False` serves prefill workers that run each batch at its own
    shape (the CPU's varlen runner): no graph can be missed, so the warmed
    batch sizes cap nothing and a batch's shape is exactly its own.
    """

    def __init__(
        self,
        config: BucketManagerConfig | None = None,
        shapes: ShapeBuckets | None = None,
        padded: bool = True,
    ) -> None:
        self.config = config or BucketManagerConfig()
        self.padded = padded
        self.shapes = shapes or ShapeBuckets(self.config.shape_buckets)
        self.buckets = AdaptiveBuckets(self.config.request_buckets, self.shapes.query_edges)
        self.controller = BatchingController(self._batching_config())
        self.tenants = {t.name: Tenant(t) for t in self.config.tenants}
        self.monitor = BucketMonitor()
        self.n_max = self.controller.config.max_num_seqs
        self._entries: dict[Hashable, _Entry] = {}
        self._seq = itertools.count()
        self._batch_ids = itertools.count()
        self._queued_kv_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._entries

    def add(self, request: BucketRequest[T]) -> None:
        """Assign a request to its bucket (Algorithm 1, lines 2-8)."""
        if not isinstance(request, BucketRequest):
            raise ValueError(f"add() takes a BucketRequest, got {type(request).__name__}")
        self._check_new(request)
        self._enqueue(request, next(self._seq))

    def remove(self, request_id: Hashable) -> BucketRequest[T] | None:
        """Take a queued request out (cancellation); None when it is not queued."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        self._dequeue(self.buckets.find(entry.request.effective_len), entry)
        return entry.request

    def adjust(self, free_blocks: int, block_size: int) -> int:
        """ADJUSTBUCKETS with N_max from Eq. 6 for the mean queued request."""
        check_int("free_blocks", free_blocks, 0)
        check_int("block_size", block_size, 1)
        mean_blocks = self._queued_kv_tokens / len(self) / block_size if len(self) else 0.0
        self.n_max = self.controller.n_max(free_blocks, mean_blocks)
        return self.buckets.adjust(self.n_max)

    def next_batch(
        self, free_blocks: int, block_size: int, now: float
    ) -> PrefillBatch[T] | None:
        """The next prefill batch for a decode pool with `free_blocks` free blocks, or None."""
        if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
            raise ValueError(f"now must be a finite number of seconds, got {now!r}")
        self.adjust(free_blocks, block_size)
        queued = [t for t in self.tenants.values() if t.queued]
        if not queued:
            return None
        aged = self._most_aged(queued, now)
        tenant = self.tenants[aged.tenant] if aged else min(queued, key=Tenant.rank)
        bucket, order = self._serving_order(tenant, aged)
        chosen: list[_Entry] = []

        def needs() -> Iterator[int]:
            for entry in order:
                chosen.append(entry)
                yield self.controller.kv_blocks(entry.request, block_size)

        n = self.controller.admit(needs(), free_blocks)
        lengths = [e.request.effective_len for e in chosen[:n]]
        n = self.controller.within_token_budget(lengths)
        if self.padded and self.config.batching.fit_batch_buckets:
            n = self._whole_rows(lengths[:n])
        if n == 0:
            return None
        for entry in chosen[:n]:
            self._dequeue(bucket, entry)
        batch = self._make_batch(tenant, bucket, chosen[:n], block_size)
        tenant.served_tokens += batch.computed_tokens
        self.monitor.record(batch)
        return batch

    def requeue(self, batch: PrefillBatch[T]) -> None:
        """Put a batch back where its requests were (a failed reservation or an expired lease)."""
        if not isinstance(batch, PrefillBatch):
            raise ValueError(f"requeue() takes a PrefillBatch, got {type(batch).__name__}")
        for request in batch.requests:
            self._check_new(request)
        if len({r.request_id for r in batch.requests}) != len(batch):
            raise ValueError(f"batch {batch.batch_id} holds a request id twice")
        tenant = self.tenants[batch.tenant]
        tenant.served_tokens = max(0.0, tenant.served_tokens - batch.computed_tokens)
        for request, key in zip(batch.requests, batch.order_keys, strict=True):
            self._enqueue(request, key[-1], key)
        self.monitor.unrecord(batch)

    def charge_output(self, tenant: str, tokens: int) -> None:
        """`tenant` was served `tokens` more output tokens: its fair share counts prompt and
        output tokens alike (prompt tokens are counted as its batches are formed)."""
        self.tenants[tenant].served_tokens += tokens

    def tokens_ahead(self, tenant: str, own: int) -> float:
        """The queued prompt tokens served before a new request of `tenant` that computes
        `own` tokens: its tenant's queue, every tenant of a better priority's, and of each
        tenant of the same priority what its weight lets it be served meanwhile (weighted
        fair share: at most its own queue)."""
        me = self.tenants[tenant]
        mine = me.queued_tokens
        ahead = float(mine)
        for other in self.tenants.values():
            if other is me or not other.queued_tokens:
                continue
            if other.config.priority < me.config.priority:
                ahead += other.queued_tokens
            elif other.config.priority == me.config.priority:
                turn = (mine + own) * other.config.weight / me.config.weight
                ahead += min(other.queued_tokens, turn)
        return ahead

    def snapshot(self) -> BucketMetrics:
        by_bucket = [
            {"low": b.low, "up": b.up, "queued": len(b), "by_tenant": b.queue_lengths()}
            for b in self.buckets
        ]
        monitor = self.monitor
        return BucketMetrics(
            num_buckets=len(self.buckets.buckets),
            boundaries=self.buckets.boundaries,
            splits=self.buckets.splits,
            merges=self.buckets.merges,
            n_max=self.n_max,
            queued=len(self),
            queue_by_bucket=by_bucket,
            queue_by_tenant={name: t.queued for name, t in self.tenants.items()},
            tokens_served_by_tenant={name: t.served_tokens for name, t in self.tenants.items()},
            expected_waste=self.buckets.expected_waste(),
            batches=monitor.batches,
            requeued_batches=monitor.requeued_batches,
            last_waste_ratio=monitor.last_waste_ratio,
            mean_waste_ratio=monitor.mean_waste_ratio,
            mean_padded_waste=monitor.mean_padded_waste,
            mean_shape_waste=monitor.mean_shape_waste,
            graph_misses=monitor.graph_misses,
            prompt_tokens=monitor.prompt_tokens,
            padded_tokens=monitor.padded_tokens,
            computed_tokens=monitor.computed_tokens,
        )

    def _batching_config(self) -> BatchingConfig:
        """Padded, no batch outgrows the largest warmed prompt batch size: that would only miss
        graphs. Unpadded runs have no graphs to miss."""
        config = self.config.batching
        if not self.padded:
            return config
        warmed = max((bs for bs, _, _ in self.shapes.prompt), default=config.max_num_seqs)
        return config.model_copy(update={"max_num_seqs": min(config.max_num_seqs, warmed)})

    def _whole_rows(self, lengths: list[int]) -> int:
        """The most of these prompts (their lengths to compute), in order, whose prompt
        bucket has no empty row; all of them when none does (a batch beyond the buckets, or
        a bucket file without such a size)."""
        longest = list(itertools.accumulate(lengths, max))
        for n in range(len(lengths), 0, -1):
            fit = self.shapes.prompt_fit(n, longest[n - 1])
            if fit is not None and fit[0] == n:
                return n
        return len(lengths)

    def _check_new(self, request: BucketRequest) -> None:
        if request.tenant not in self.tenants:
            raise ValueError(
                f"request {request.request_id!r}: unknown tenant {request.tenant!r}; "
                f"configured tenants are {sorted(self.tenants)}"
            )
        if request.request_id in self._entries:
            raise ValueError(f"request {request.request_id!r} is already queued")
        self.buckets.check_length(request.prompt_len)

    def _enqueue(self, request: BucketRequest, seq: int, key: OrderKey | None = None) -> None:
        tenant = self.tenants[request.tenant]
        key = key or tenant.order_key(request, seq)
        if not tenant.queued:
            self._catch_up(tenant)
        self.buckets.push(key, request)
        tenant.queued += 1
        tenant.queued_tokens += request.effective_len
        tenant.track(request, seq)
        self._entries[request.request_id] = _Entry(request, key)
        self._queued_kv_tokens += request.kv_tokens(self.config.batching.count_output_tokens)

    def _dequeue(self, bucket: RequestBucket, entry: _Entry) -> None:
        request = bucket.pop(entry.request.tenant, entry.key)
        tenant = self.tenants[request.tenant]
        tenant.queued -= 1
        tenant.queued_tokens -= request.effective_len
        del self._entries[request.request_id]
        self._queued_kv_tokens -= request.kv_tokens(self.config.batching.count_output_tokens)

    def _catch_up(self, tenant: Tenant) -> None:
        """A tenant back from idle starts at its busy peers' share, not with a backlog of credit."""
        peers = [
            t.share
            for t in self.tenants.values()
            if t.queued and t.config.priority == tenant.config.priority
        ]
        if peers:
            tenant.served_tokens = max(tenant.served_tokens, min(peers) * tenant.config.weight)

    def _is_queued(self, request: BucketRequest, seq: int) -> bool:
        entry = self._entries.get(request.request_id)
        return entry is not None and entry.key[-1] == seq

    def _most_aged(self, tenants: list[Tenant], now: float) -> BucketRequest | None:
        """The earliest-arriving of the tenants' oldest queued requests that waited their
        tenant's `max_wait_s`; None when none has waited that long."""
        aged = [
            (oldest.arrival_time, tenant.name, oldest)
            for tenant in tenants
            if (oldest := tenant.oldest(self._is_queued)) is not None
            and tenant.is_aged(oldest, now)
        ]
        return min(aged)[2] if aged else None

    def _serving_order(
        self, tenant: Tenant, aged: BucketRequest | None
    ) -> tuple[RequestBucket, Iterator[_Entry]]:
        """`aged` (from `_most_aged`, one of `tenant`'s) first, then its bucket in policy
        order; without one, the bucket holding the tenant's first request in policy order."""
        if aged is not None:
            first = self._entries[aged.request_id]
            bucket = self.buckets.find(aged.effective_len)
        else:
            first = None
            bucket = min(
                (b for b in self.buckets if b.queues.get(tenant.name)),
                key=lambda b: b.queues[tenant.name].head(),
            )
        rest = (
            _Entry(request, key)
            for key, request in bucket.queues[tenant.name]
            if first is None or key != first.key
        )
        return bucket, itertools.chain([first] if first else [], rest)

    def _make_batch(
        self, tenant: Tenant, bucket: RequestBucket, entries: list[_Entry], block_size: int
    ) -> PrefillBatch[T]:
        requests = tuple(e.request for e in entries)
        lengths = [r.effective_len for r in requests]
        # the cached prefix is context the queries attend to, in the shapes' blocks
        ctx = -(-max(r.cached_len for r in requests) // self.shapes.config.block_size)
        need = (len(requests), max(lengths), ctx)
        if self.padded and ctx and self.shapes.prompt_fit(*need) is None:
            # no bucket with that context: the whole prompts' rectangle, whose rows compute
            # their uncached tokens over the cached ones
            need = (len(requests), max(r.prompt_len for r in requests), 0)
        if self.padded:
            shape, miss = self.shapes.pad_prompt(*need)
        else:
            shape, miss = need, False
        return PrefillBatch(
            batch_id=next(self._batch_ids),
            tenant=tenant.name,
            requests=requests,
            bucket=(bucket.low, bucket.up),
            shape=shape,
            graph_miss=miss,
            kv_blocks_per_request=tuple(self.controller.kv_blocks(r, block_size) for r in requests),
            block_size=block_size,
            waste_ratio=waste_ratio(lengths),
            padded_waste=padded_waste(lengths, shape[1]),
            shape_waste=padded_waste(lengths, shape[1], shape[0]),
            padded_tokens=shape[0] * shape[1] if self.padded else sum(lengths),
            order_keys=tuple(e.key for e in entries),
        )
