"""PrefillWorker's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from bucket_manager.config import ShapeBucketConfig
from deploy.worker_env import check_worker_options
from kv_transfer.transport import check_transport
from runtime.model_runner import ModelRunnerConfig


@dataclass
class PrefillWorkerConfig:
    """`shape_buckets` holds the prompt shapes this worker warms and pads to.

    `pad_to_shape_buckets`: "auto" pads on hpu / cuda (fixed-shape graphs)
    and not on cpu. `warmup`: "auto" runs every prompt shape when padding,
    else only the smallest; "all", "smallest" or "none" force a choice.
    Blocks of a finished batch stay held under a lease until the decode side
    acknowledges, or for `lease_ttl_s` at most.
    """

    name: str = "prefill-0"
    runner: ModelRunnerConfig = field(default_factory=ModelRunnerConfig)
    shape_buckets: ShapeBucketConfig = field(default_factory=ShapeBucketConfig)
    pad_to_shape_buckets: str | bool = "auto"
    warmup: str = "auto"
    transport: str = "ray"
    lease_ttl_s: float = 60.0
    torch_threads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"PrefillWorkerConfig.name must be a non-empty str, got {self.name!r}")
        check_worker_options(
            "PrefillWorkerConfig", self.pad_to_shape_buckets, self.warmup, self.torch_threads
        )
        check_transport(self.transport)
        ttl = self.lease_ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
            raise ValueError(f"PrefillWorkerConfig.lease_ttl_s must be > 0, got {ttl!r}")
