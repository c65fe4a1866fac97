"""DecodeWorker's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from bucket_manager.config import ShapeBucketConfig
from deploy.worker_env import check_worker_options
from kv_transfer.transport import check_transport
from runtime.engine_config import EngineConfig


@dataclass
class DecodeWorkerConfig:
    """`engine` is the continuous-batching engine (model runner, scheduler, pipeline depth);
    `shape_buckets` holds the decode shapes `(batch, 1, blocks)` microbatches pad to.

    Reserved blocks whose KV is not admitted within `lease_ttl_s` are freed.
    `admit_delay_s` holds admissions back that long first: a fault drill for
    acknowledgements that come too late (the first `admit_delay_count` of
    them; 0 means every one).
    """

    name: str = "decode-0"
    engine: EngineConfig = field(default_factory=EngineConfig)
    shape_buckets: ShapeBucketConfig = field(default_factory=ShapeBucketConfig)
    pad_to_shape_buckets: str | bool = "auto"
    warmup: str = "auto"
    transport: str = "ray"
    lease_ttl_s: float = 60.0
    torch_threads: int | None = None
    admit_delay_s: float = 0.0
    admit_delay_count: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"DecodeWorkerConfig.name must be a non-empty str, got {self.name!r}")
        check_worker_options(
            "DecodeWorkerConfig", self.pad_to_shape_buckets, self.warmup, self.torch_threads
        )
        check_transport(self.transport)
        count = self.admit_delay_count
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"DecodeWorkerConfig.admit_delay_count must be an integer >= 0, got {count!r}"
            )
        for name, bound in (("lease_ttl_s", "> 0"), ("admit_delay_s", ">= 0")):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not (value > 0 if bound == "> 0" else value >= 0):
                raise ValueError(
                    f"DecodeWorkerConfig.{name} must be a number {bound}, got {value!r}"
                )
