"""DecodeWorker's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from bucketserve.kv_worker.config import WorkerConfig
from bucketserve.runtime.engine.engine_config import EngineConfig
from bucketserve.utils.checks import check_pace


@dataclass
class DecodeWorkerConfig(WorkerConfig):
    """`engine` is the continuous-batching engine (model runner, scheduler, pipeline depth);
    `shape_buckets` holds the decode shapes `(batch, 1, blocks)` microbatches pad to.

    Reserved blocks whose KV is not admitted within `lease_ttl_s` are freed.
    `admit_delay_s` holds admissions back that long first: a fault drill (tests only, no
    config key) for acknowledgements that come too late (the first `admit_delay_count` of
    them; 0 means every one). A step running longer than `stall_timeout_s`
    makes every later call fail: the worker is hung and gets restarted.
    `prefills`: the colocated topology, where this worker's engine also prefills, so in
    graphs mode its warm-up compiles the prompt buckets too.
    `pace`: while a prefill batch for this worker is in flight (a lease is open), a step
    waits until a running sequence would otherwise get its next token later than this
    fraction of its TPOT target (`bucketserve.decode_worker.pacer`); None never waits. For workers
    whose cores a prefill worker shares.
    """

    name: str = "decode-0"
    engine: EngineConfig = field(default_factory=EngineConfig)
    admit_delay_s: float = 0.0
    admit_delay_count: int = 0
    stall_timeout_s: float | None = None
    prefills: bool = False
    pace: float | None = None

    def __post_init__(self) -> None:
        check_pace("DecodeWorkerConfig.pace", self.pace)
