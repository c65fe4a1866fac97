"""DecodeWorker's configuration."""

from __future__ import annotations

from pydantic import Field

from bucketserve.kv_worker.config import WorkerConfig
from bucketserve.runtime.engine.engine_config import EngineConfig
from bucketserve.utils.settings import Settings


class PacingSettings(Settings):
    """How a decode worker yields its cores to a prefill worker on the same cores."""

    pace: float | None = Field(None, gt=0, le=1)
    """Disaggregated, prefill on the same cores: while a prefill batch for the worker runs,
    a step waits until a request would get its next token later than this fraction of its
    TPOT target (e.g. 0.8), so the prefill worker gets the cores
    (`bucketserve.decode_worker.pacer`); null: never waits."""


class DecodeWorkerConfig(WorkerConfig, PacingSettings):
    """`engine` is the continuous-batching engine (model runner, scheduler); the worker
    builds its stages and ranks from its own `pipeline_parallel_size` and
    `tensor_parallel_size`. `shape_buckets` holds the decode shapes `(batch, 1, blocks)`
    microbatches pad to.

    Reserved blocks whose KV is not admitted within `lease_ttl_s` are freed.
    `admit_delay_s` holds admissions back that long first: a fault drill (tests only)
    for acknowledgements that come too late (the first `admit_delay_count` of them; 0
    means every one). A step running longer than `stall_timeout_s` makes every later
    call fail: the worker is hung and gets restarted. `prefills`: this worker's engine
    also prefills (colocated, or remote_prefill other than always), so in graphs mode
    its warm-up compiles the prompt buckets too.
    """

    name: str = Field("decode-0", exclude=True)
    engine: EngineConfig = Field(default_factory=EngineConfig, exclude=True)
    admit_delay_s: float = Field(0.0, exclude=True)
    admit_delay_count: int = Field(0, exclude=True)
    stall_timeout_s: float | None = Field(None, exclude=True)
    prefills: bool = Field(False, exclude=True)
