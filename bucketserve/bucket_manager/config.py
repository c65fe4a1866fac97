"""Config of the bucket manager, one model per component: the config file's `buckets` and
`tenants` sections are these (`BucketsSettings` joins the shape and request keys), and the
simulator and the benchmarks build them directly. `BucketManagerConfig` bundles them.
"""

from __future__ import annotations

import hashlib
import re
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator

from bucketserve import envs
from bucketserve.runtime.core.tenant_tag import TenantTag
from bucketserve.utils.settings import Settings, SettingsError

BUCKET_FILE_ENV = "BUCKETSERVE_BUCKET_FILE"
ShapeStrategy = Literal["exponential", "linear", "file", "unified"]
STRATEGIES = typing.get_args(ShapeStrategy)
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
BURST_SECONDS = 10.0  # default token_burst: this many seconds of token_rate_limit
# keys whose plaintext ships with the project (bucketserve/deploy/serve.yaml): anyone has them
DEMO_API_KEYS = ("interactive-demo-key", "batch-demo-key")


class BucketRange(Settings):
    """[min, step, max] or [min, step, max, limit] of one shape dimension (or a mapping);
    positional in code, `BucketRange(1, 1, 4, 3)`."""

    min: int = Field(ge=0)
    step: int = Field(ge=1)
    max: int = Field(ge=0)
    limit: int | None = Field(None, ge=1)
    """Points of the exponential strategy (the linear one ignores it)."""

    def __init__(self, *args: int | None, **data: Any) -> None:
        super().__init__(**dict(zip(("min", "step", "max", "limit"), args, strict=False)), **data)

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, data: Any) -> Any:
        if not isinstance(data, (list, tuple)):
            return data
        if len(data) not in (3, 4):
            raise ValueError("must be [min, step, max] or [min, step, max, limit]")
        return dict(zip(("min", "step", "max", "limit"), data, strict=False))

    @model_validator(mode="after")
    def _ordered(self) -> BucketRange:
        if self.max < self.min:
            raise SettingsError("max", f"must be >= min ({self.min}), got {self.max}")
        return self

    def as_list(self, with_limit: bool = True) -> list[int | None]:
        head: list[int | None] = [self.min, self.step, self.max]
        return [*head, self.limit] if with_limit else head


def _at_least_one(dim: str, rng: BucketRange) -> None:
    if rng.min < 1:
        raise SettingsError(f"{dim}.min", f"must be >= 1, got {rng.min}")


class PromptShapeConfig(Settings):
    """Prompt shape buckets `(batch, query, context blocks)`; a dimension left out takes
    its default here."""

    bs: BucketRange = BucketRange(1, 1, 1, 1)
    """Batch sizes."""
    query: BucketRange = BucketRange(128, 128, 1024, 11)
    """Query lengths (tokens)."""
    ctx: BucketRange | None = None
    """Context blocks beside the query; null: every count that fits."""

    @model_validator(mode="after")
    def _positive(self) -> PromptShapeConfig:
        _at_least_one("bs", self.bs)
        _at_least_one("query", self.query)
        return self


class DecodeShapeConfig(Settings):
    """Decode shape buckets `(batch, 1, blocks)`."""

    bs: BucketRange = BucketRange(1, 2, 4, 3)
    """Batch sizes."""
    blocks: BucketRange = BucketRange(128, 128, 5888, 14)
    """KV blocks of the whole batch."""

    @model_validator(mode="after")
    def _positive(self) -> DecodeShapeConfig:
        _at_least_one("bs", self.bs)
        return self


class ShapeBucketConfig(Settings):
    """Shape buckets `(batch, query, context blocks)` for prompt and decode.

    The defaults are [Bucketing]'s start-up examples (36 prompt, 42 decode
    buckets; 375 unified ones). `strategy == "unified"` adds the doc's unified buckets
    `(query, shared blocks, unique blocks, is_causal)`, which every step of an engine pads
    to, prompt chunks and decode rows together: their points come from `max_num_seqs` and
    `max_num_batched_tokens` (an engine's step limits) and `num_blocks` (its KV pool),
    which a decode worker sets to its own. The prompt and decode ranges still give the
    prefill batches' shapes, spaced exponentially. The model's and the engine's numbers
    (`block_size` to `num_blocks`) are set by the code (a service from its model and
    pool, `bucketserve buckets` from its flags).
    """

    strategy: ShapeStrategy = "exponential"
    """Shape buckets: exponential, linear or file; unified: every decode-worker step (prompt
    chunks and decode rows together) pads to (query, shared blocks, unique blocks,
    is_causal) buckets from the engine's max_num_seqs, max_num_batched_tokens and pool."""
    file: str | None = None
    """The bucket file of the file strategy (or $BUCKETSERVE_BUCKET_FILE)."""
    prompt: PromptShapeConfig = PromptShapeConfig()
    decode: DecodeShapeConfig = DecodeShapeConfig()
    block_size: int = Field(128, ge=1, exclude=True)
    max_model_len: int = Field(1024, ge=1, exclude=True)
    max_num_seqs: int = Field(32, ge=1, exclude=True)
    max_num_batched_tokens: int = Field(2048, ge=1, exclude=True)
    num_blocks: int = Field(5781, ge=1, exclude=True)

    @model_validator(mode="after")
    def _strategy_inputs(self) -> Self:
        if self.strategy in ("exponential", "unified"):
            for phase in ("prompt", "decode"):
                ranges = getattr(self, phase)  # None in BucketsSettings: the model's
                unbounded = [d for d, r in dict(ranges or {}).items() if r and r.limit is None]
                if unbounded:
                    raise SettingsError(
                        f"{phase}.{unbounded[0]}.limit", "is required by the exponential strategy"
                    )
        if self.strategy == "file" and self.bucket_file() is None:
            raise SettingsError(
                "file", f"is required by the 'file' strategy (or set ${BUCKET_FILE_ENV})"
            )
        return self

    def bucket_file(self) -> str | None:
        return self.file or envs.BUCKETSERVE_BUCKET_FILE or None

    def for_engine(
        self, max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int
    ) -> ShapeBucketConfig:
        """The unified strategy's points sized for one engine's limits and KV pool (other
        strategies do not read them: returned unchanged)."""
        if self.strategy != "unified":
            return self
        return self.model_copy(update={
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "num_blocks": num_blocks,
        })  # fmt: skip

    @classmethod
    def from_dict(cls, data: Any, where: str = "shape_buckets") -> ShapeBucketConfig:
        """`bucketserve buckets`' mapping (a file's keys and the engine's numbers its flags
        give); SettingsError names the key."""
        return cls.parse(data, where, file=False)


class RequestBucketConfig(Settings):
    """Algorithm 1: request buckets over prompt lengths `[0, max_len)`.

    `shape_edge_snap` (set by tests and benchmarks): a split point moves to the nearest
    warmed prompt query length when that edge lies within this fraction of the bucket's
    width of the midpoint (0 disables).
    """

    theta: float = Field(0.5, gt=0, le=1)
    """θ: split a request bucket when more than this share of it lies below its middle."""
    max_len: int | None = Field(None, ge=2)
    """L_max: request buckets cover [0, L_max); sets model.max_model_len. null: the
    model's length."""
    max_buckets: int = Field(64, ge=1)
    """Most request buckets."""
    shape_edge_snap: float = Field(0.125, ge=0, le=0.5, exclude=True)


def hash_api_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _digest(value: str) -> str:
    if not _SHA256_HEX.fullmatch(value):
        raise ValueError("must be 64 lowercase hex digits (the sha256 digest of a key)")
    return value


class TenantConfig(Settings):
    """One tenant, as the config's `tenants` list gives it: the bucket manager's policy
    (class, order, priority, weight, aging, SLO targets, cache domain and share, shedding)
    and what the gateway enforces at admission (keys, concurrency, token rate). Keys are
    kept only as sha256 hex digests. Lower `priority` is served first (vLLM's
    convention); a request that waited `max_wait_s` is served next whatever its length,
    its tenant's priority or fair share, so a low-priority tenant waits but never
    starves."""

    model_config = ConfigDict(validate_by_name=True)

    name: str = Field(min_length=1)
    """The tenant's name (metrics, logs, and `default` for the open tenant)."""
    tenant_class: Literal["online", "offline"] = Field("online", alias="class")
    """online: served by earliest arrival; offline: by the tenant's `policy`."""
    policy: Literal["fcfs", "sjf", "ljf"] = "fcfs"
    """Order within the tenant: fcfs, or for offline tenants sjf / ljf (shortest / longest
    job first)."""
    priority: int = 0
    """Lower is served first."""
    weight: float = Field(1.0, gt=0)
    """Fair share against tenants of the same priority."""
    max_wait_s: float | None = Field(30.0, gt=0)
    """Aging bound: a request that waited this long is served next, whatever its priority
    (null: no aging)."""
    ttft_slo_s: float | None = Field(None, gt=0)
    """Time-to-first-token target of the tenant's requests (null: none)."""
    tpot_slo_s: float | None = Field(None, gt=0)
    """Time-per-output-token target of the tenant's requests (null: none)."""
    api_keys: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    """Plaintext keys, hashed when read."""
    api_key_sha256: list[Annotated[str, AfterValidator(_digest)]] = Field(default_factory=list)
    """sha256 hex digests of the keys (the form to keep in a file)."""
    max_concurrent_requests: int | None = Field(None, ge=1)
    """Requests of the tenant in flight at once (null: no bound)."""
    token_rate_limit: float | None = Field(None, gt=0)
    """Prompt + output tokens per second (null: no bound)."""
    token_burst: float | None = Field(None, ge=1)
    """Tokens the rate limit lets through at once (null: 10 s of token_rate_limit)."""
    cache_domain: str | None = Field(None, min_length=1)
    """The prefix-cache domain its requests read and name cached blocks in (null: the
    tenant's own, so no other tenant's request hits its blocks; tenants that trust each
    other name one domain to share them). A request's `cache_salt` narrows it further."""
    cache_share: float | None = Field(None, gt=0, le=1)
    """The fraction of a KV pool's evictable cached blocks the tenant may hold while others
    want room: eviction takes from the tenant most over its share first (null: no bound)."""
    shed: Literal["never", "predicted"] = "never"
    """predicted: a request the queue ahead would make miss its TTFT target (its own, else
    the tenant's `ttft_slo_s`) is answered at once with 429 and Retry-After (gRPC
    RESOURCE_EXHAUSTED with RetryInfo) instead of queueing; offline tenants always queue."""

    @field_validator("api_keys", "api_key_sha256", mode="before")
    @classmethod
    def _one_key(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("api_keys", mode="after")
    @classmethod
    def _hashed(cls, keys: list[str]) -> list[str]:
        return [hash_api_key(k) for k in keys]  # the plaintext is not kept

    @model_validator(mode="after")
    def _consistent(self) -> TenantConfig:
        if self.token_burst is not None and self.token_rate_limit is None:
            raise SettingsError("token_burst", "token_burst needs token_rate_limit")
        if self.tenant_class == "online" and self.policy != "fcfs":
            raise SettingsError(
                "policy",
                f"online tenants are served by earliest arrival, so policy must be 'fcfs'; "
                f"got {self.policy!r} (use class 'offline' for sjf / ljf)",
            )
        return self

    @property
    def api_key_hashes(self) -> frozenset[str]:
        return frozenset((*self.api_keys, *self.api_key_sha256))

    @property
    def burst(self) -> float | None:
        """The token bucket's capacity (null: no rate limit)."""
        if self.token_rate_limit is None:
            return None
        return self.token_burst or max(1.0, BURST_SECONDS * self.token_rate_limit)

    @property
    def demo_keys(self) -> list[str]:
        """The published demo keys this tenant accepts."""
        return [key for key in DEMO_API_KEYS if hash_api_key(key) in self.api_key_hashes]

    def tag(self, cache_salt: str | None = None) -> TenantTag:
        """What the engine core knows of a request of this tenant."""
        return TenantTag(self.name, self.weight, self.cache_domain or self.name, cache_salt)

    @property
    def sheds(self) -> bool:
        """Whether a request predicted to miss its TTFT target (its own, else the tenant's)
        is refused at once."""
        return self.shed == "predicted" and self.tenant_class == "online"


class BatchingConfig(Settings):
    """Prefill batches (the config file's `buckets.batching`): Eq. 5-6 in KV blocks, a batch
    fits `safety_fraction` x the decode pool's free blocks. `count_output_tokens`: a request
    needs ceil((prompt_len + max_tokens) / block_size) blocks, the most its sequence can
    hold, so an admitted batch never outgrows its reservation; False counts the prompt only
    (for pools that preempt instead). `fit_batch_buckets`: a batch padded to shape buckets
    takes as many requests as fill a warmed batch size exactly (5 that fit become 4, not 8
    rows with 3 empty); the rest form the next batch, which the next free prefill slot runs.
    An empty row costs a whole prompt's compute, so on compute-bound prefill both batches
    together cost less than the padded one. Unpadded batches are never trimmed."""

    safety_fraction: float = Field(0.9, gt=0, le=1)
    """A prefill batch fits this share of the decode pool's free blocks (Eq. 5-6)."""
    max_num_seqs: int = Field(256, ge=1)
    """Requests in one prefill batch (padded: also at most the largest prompt bs)."""
    max_batched_tokens: int | None = Field(2048, ge=1)
    """Prompt tokens per prefill batch (a longer prompt goes alone), as vLLM's
    max_num_batched_tokens bounds one forward: how long a request can wait behind one;
    raise it for offline work. null: no bound."""
    count_output_tokens: bool = Field(True, exclude=True)
    fit_batch_buckets: bool = Field(True, exclude=True)


DEFAULT_TENANT = "default"


def default_tenant() -> TenantConfig:
    """The one tenant of a service that names none: online, FCFS, and the latency targets
    the project's benchmarks judge by (TTFT 4 s, TPOT 0.25 s: about a reader's pace), so
    the decode engines know when a request's first token is due. A tenant named `default`
    without API keys replaces it and keeps the service open."""
    return TenantConfig(name=DEFAULT_TENANT, ttft_slo_s=4.0, tpot_slo_s=0.25)


def _default_tenants() -> tuple[TenantConfig, ...]:
    return (default_tenant(),)


@dataclass(frozen=True)
class BucketManagerConfig:
    """Everything BucketManager needs; with no tenants named, one online FCFS `default`."""

    request_buckets: RequestBucketConfig = field(default_factory=RequestBucketConfig)
    shape_buckets: ShapeBucketConfig = field(default_factory=ShapeBucketConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    tenants: tuple[TenantConfig, ...] = field(default_factory=_default_tenants)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenants", tuple(self.tenants))
        if self.request_buckets.max_len is None:  # the model's length
            length = {"max_len": max(self.shape_buckets.max_model_len, 2)}
            requests = self.request_buckets.model_copy(update=length)
            object.__setattr__(self, "request_buckets", requests)
        if not self.tenants:
            raise ValueError("BucketManagerConfig.tenants must name at least one tenant")
        names = [t.name for t in self.tenants]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"BucketManagerConfig.tenants: duplicate tenant names {duplicates}")
