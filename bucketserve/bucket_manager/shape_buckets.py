"""Shape buckets `(batch, query, context blocks)`: generation, padding lookup, graph misses."""

from __future__ import annotations

import bisect
import itertools
import logging
from typing import NamedTuple

from bucketserve.bucket_manager.bucket_file import (
    BucketFileParser,
    ShapeBucket,
    split_prompt_decode,
)
from bucketserve.bucket_manager.bucket_range import dimension_values
from bucketserve.bucket_manager.config import BucketRange, ShapeBucketConfig
from bucketserve.bucket_manager.unified_buckets import (
    UnifiedBucket,
    UnifiedFit,
    generate_unified,
    unified_ranges,
)
from bucketserve.utils.checks import check_int

logger = logging.getLogger(__name__)


class PaddedShape(NamedTuple):
    shape: ShapeBucket | UnifiedBucket
    graph_miss: bool


class ShapeBuckets:
    """The warmed prompt and decode shapes, and the smallest one a batch pads to.

    "Smallest" is the least padded volume bs x query x (blocks + 1), ties by
    the tuple; on the generated grids that is the per-dimension smallest fit.
    A batch beyond every bucket runs unpadded: a logged warning and a counted
    graph miss. The unified strategy adds `unified`, the buckets every engine step pads
    to (`pad_unified`); the prompt and decode buckets stay for prefill batches.
    """

    def __init__(self, config: ShapeBucketConfig | None = None, log: bool = True) -> None:
        self.config = config or ShapeBucketConfig()
        if self.config.strategy == "file":
            path = self.config.bucket_file()
            prompt, decode = split_prompt_decode(BucketFileParser().parse_file(path))
        else:
            prompt, decode = self._generate_prompt(), self._generate_decode()
        self.prompt: list[ShapeBucket] = prompt
        self.decode: list[ShapeBucket] = decode
        self._prompt_index = _SmallestFit(prompt)
        self._decode_index = _SmallestFit(decode)
        unified = self.config.strategy == "unified"
        self.unified: list[UnifiedBucket] = generate_unified(self.config) if unified else []
        self._unified_index = UnifiedFit(self.unified)
        self.graph_misses = 0
        if log:
            for line in self.describe():
                logger.info(line)

    def _generate_prompt(self) -> list[ShapeBucket]:
        cfg, strategy = self.config, self._range_strategy
        bs = dimension_values(strategy, cfg.prompt.bs)
        query = dimension_values(strategy, cfg.prompt.query)
        max_ctx = max((cfg.max_model_len - query[0]) // cfg.block_size, 0)
        ctx_range = cfg.prompt.ctx or BucketRange(0, 1, max_ctx)
        ctx = dimension_values("linear" if cfg.prompt.ctx is None else strategy, ctx_range)
        return sorted(
            (b, q, c)
            for b, q, c in itertools.product(bs, query, ctx)
            if q + c * cfg.block_size <= cfg.max_model_len
        )

    def _generate_decode(self) -> list[ShapeBucket]:
        cfg, strategy = self.config, self._range_strategy
        bs = dimension_values(strategy, cfg.decode.bs)
        blocks = dimension_values(strategy, cfg.decode.blocks)
        return sorted((b, 1, n) for b, n in itertools.product(bs, blocks))

    @property
    def _range_strategy(self) -> str:
        """How the prompt and decode ranges are spaced: unified keeps them exponential."""
        return "exponential" if self.config.strategy == "unified" else self.config.strategy

    @property
    def query_edges(self) -> list[int]:
        """The warmed prompt query lengths (context 0): where request buckets may split."""
        return sorted({q for _, q, c in self.prompt if c == 0})

    def prompt_fit(
        self, batch_size: int, query_len: int, ctx_blocks: int = 0
    ) -> ShapeBucket | None:
        """The prompt bucket a batch would pad to, or None; counts no miss."""
        return self._prompt_index.find((batch_size, query_len, ctx_blocks))

    def pad_prompt(self, batch_size: int, query_len: int, ctx_blocks: int = 0) -> PaddedShape:
        return self._pad(self._prompt_index, "prompt", (batch_size, query_len, ctx_blocks))

    def pad_decode(self, batch_size: int, num_blocks: int) -> PaddedShape:
        return self._pad(self._decode_index, "decode", (batch_size, 1, num_blocks))

    def pad_unified(self, need: UnifiedBucket) -> PaddedShape:
        """The unified bucket of a step's `(query, shared, unique, is_causal)`
        (`unified_need`); beyond every bucket: the need itself and a counted miss."""
        if not self.unified:
            raise ValueError(f"strategy {self.config.strategy!r} has no unified buckets")
        names = ("query_len", "shared_blocks", "unique_blocks", "is_causal")
        return self._pad(self._unified_index, "unified", need, names, (1, 0, 0, 0))

    def _pad(
        self,
        index: _SmallestFit | UnifiedFit,
        phase: str,
        need: tuple[int, ...],
        names: tuple[str, ...] = ("batch_size", "query_len", "blocks"),
        minimums: tuple[int, ...] = (1, 1, 0),
    ) -> PaddedShape:
        for name, value, minimum in zip(names, need, minimums, strict=True):
            check_int(f"{phase} {name}", value, minimum)
        bucket = index.find(need)
        if bucket is not None:
            return PaddedShape(bucket, False)
        self.graph_misses += 1
        logger.warning(
            "%s batch %s exceeds every warmed %s bucket; running it unpadded (graph miss %d)",
            phase,
            need,
            phase,
            self.graph_misses,
        )
        return PaddedShape(need, True)

    def describe(self) -> list[str]:
        """The configuration and the generated buckets, in [Bucketing]'s log format."""
        cfg = self.config
        if cfg.strategy == "file":
            head = [f"Bucket file: {cfg.bucket_file()}"]
        else:
            exp = self._range_strategy == "exponential"
            params = "(min, step, max_warmup, limit)" if exp else "(min, step, max_warmup)"
            p, d = cfg.prompt, cfg.decode
            head = [
                f"Prompt bucket config {params} bs:{p.bs.as_list(exp)}, "
                f"seq:{p.query.as_list(exp)}",
                f"Decode bucket config {params} bs:{d.bs.as_list(exp)}, "
                f"block:{d.blocks.as_list(exp)}",
            ]
        unified = []
        if cfg.strategy == "unified":
            query, shared, unique = unified_ranges(cfg)
            unified = [
                f"Unified bucket config (max_num_seqs, max_num_batched_tokens, num_blocks) "
                f"[{cfg.max_num_seqs}, {cfg.max_num_batched_tokens}, {cfg.num_blocks}] "
                f"query:{query}, shared_blocks:{shared}, unique_blocks:{unique}",
                f"Generated {len(self.unified)} unified buckets "
                f"[query, shared_blocks, unique_blocks]: {self.unified}",
            ]
        return [
            *unified,
            *head,
            f"Generated {len(self.prompt)} prompt buckets [bs, query, num_blocks]: {self.prompt}",
            f"Generated {len(self.decode)} decode buckets [bs, query, num_blocks]: {self.decode}",
        ]


class _SmallestFit:
    """Smallest bucket >= a shape in every dimension.

    The per-dimension smallest fit, when it is a bucket, dominates every other
    fit (the generated grids); otherwise a scan in order of padded volume.
    """

    def __init__(self, buckets: list[ShapeBucket]) -> None:
        self._members = set(buckets)
        self._dims = [sorted({b[i] for b in buckets}) for i in range(3)]
        self._by_cost = sorted(buckets, key=lambda b: (b[0] * b[1] * (b[2] + 1), b))

    def find(self, need: ShapeBucket) -> ShapeBucket | None:
        fit = []
        for values, want in zip(self._dims, need, strict=True):
            i = bisect.bisect_left(values, want)
            if i == len(values):
                return None
            fit.append(values[i])
        if tuple(fit) in self._members:
            return tuple(fit)
        for bucket in self._by_cost:
            if all(have >= want for have, want in zip(bucket, need, strict=True)):
                return bucket
        return None
