"""DecodeWorker's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from bucketserve.kv_worker.config import WorkerConfig
from bucketserve.runtime.engine.engine_config import EngineConfig


@dataclass
class DecodeWorkerConfig(WorkerConfig):
    """`engine` is the continuous-batching engine (model runner, scheduler, pipeline depth);
    `shape_buckets` holds the decode shapes `(batch, 1, blocks)` microbatches pad to.

    Reserved blocks whose KV is not admitted within `lease_ttl_s` are freed.
    `admit_delay_s` holds admissions back that long first: a fault drill for
    acknowledgements that come too late (the first `admit_delay_count` of
    them; 0 means every one). A step running longer than `stall_timeout_s`
    makes every later call fail: the worker is hung and gets restarted.
    `prefills`: the colocated shape, where this worker's engine also prefills, so in
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
        super().__post_init__()
        self._check_number("admit_delay_s", positive=False)
        count = self.admit_delay_count
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"DecodeWorkerConfig.admit_delay_count must be an integer >= 0, got {count!r}"
            )
        check_pace("DecodeWorkerConfig.pace", self.pace)


def check_pace(where: str, pace: object) -> None:
    ok = isinstance(pace, (int, float)) and not isinstance(pace, bool) and 0 < pace <= 1
    if pace is not None and not ok:
        raise ValueError(
            f"{where} must be null (never hold decode steps) or a fraction of the TPOT target "
            f"in (0, 1], e.g. 0.8; got {pace!r}"
        )
