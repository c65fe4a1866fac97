"""The three systems the experiments compare, built on one cluster config.

- `bucketserve`: the real BucketManager (Algorithm 1, Eq. 5-6 counting prompt + max_tokens,
  tenant policies), batches padded to its shape buckets (linear grid: batch sizes in steps
  of max_num_seqs / 32, query lengths in steps of 128), disaggregated.
- `fcfs`: DistServe-like, the same disaggregated cluster with one FCFS queue, batches padded
  to their longest prompt, prompt-only reservations and preemption on the decode side.
- `static`: UELLM-like static batching on aggregated replicas.

`SystemConfig.prefix_caching` gives the disaggregated systems' workers a prefix cache, and
`cache_aware` places batches by it (see `simulator.py`); BucketServe's shapes then also
cover cached context, in steps of `CTX_STEP` shape blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.fcfs_disagg import FcfsBatcher
from benchmarks.simulator.metrics import RunResult
from benchmarks.simulator.simulator import Simulator
from benchmarks.simulator.static_batching import StaticBatchingSimulator
from benchmarks.simulator.workload import SimRequest
from bucketserve.bucket_manager import (
    BatchingConfig,
    BucketManager,
    BucketManagerConfig,
    BucketRange,
    PromptShapeConfig,
    RequestBucketConfig,
    ShapeBucketConfig,
    TenantConfig,
)
from bucketserve.utils.checks import check_choice

SYSTEMS = ("bucketserve", "fcfs", "static")
SHAPE_BLOCK = 128
CTX_STEP = 4  # shape blocks: context buckets every 512 tokens


@dataclass(frozen=True)
class SystemConfig:
    """Knobs of the systems beyond the cluster: BucketServe's tenant class and policy, its
    bucket cap and KV accounting; the padding of each disaggregated system (None: its own
    default, `shape` for bucketserve and `longest` for fcfs); the workers' prefix caches,
    cache-aware placement and the batches a prefill worker takes at once; which prompts go
    to a prefill worker (`remote_prefill`) and whether K/V ships layer by layer."""

    offline: bool = False
    policy: str = "sjf"
    max_buckets: int = 64
    count_output_tokens: bool = True
    pad: str | None = None
    fcfs_max_batched_tokens: int | None = None
    prefix_caching: bool = False
    cache_aware: bool = False
    max_batches_per_prefill: int = 1
    remote_prefill: str = "always"  # the service's controller.remote_prefill
    layerwise: bool = False  # K/V leaves each layer as it is computed

    def tenant(self) -> TenantConfig:
        if self.offline:
            return TenantConfig(name="batch", tenant_class="offline", policy=self.policy)
        return TenantConfig(name="default")


def bucket_manager_config(cluster: ClusterConfig, system: SystemConfig) -> BucketManagerConfig:
    max_len = cluster.model_spec.max_len
    n = cluster.max_num_seqs
    most_ctx = max_len // SHAPE_BLOCK if system.prefix_caching else 0
    shapes = ShapeBucketConfig(
        strategy="linear",
        block_size=SHAPE_BLOCK,
        max_model_len=max_len,
        prompt=PromptShapeConfig(
            bs=BucketRange(1, max(1, n // 32), n),
            query=BucketRange(SHAPE_BLOCK, SHAPE_BLOCK, max_len),
            ctx=BucketRange(0, CTX_STEP if most_ctx else 1, most_ctx),
        ),
    )
    return BucketManagerConfig(
        request_buckets=RequestBucketConfig(max_len=max_len, max_buckets=system.max_buckets),
        shape_buckets=shapes,
        batching=BatchingConfig(  # the paper bounds batches by memory alone: no token budget
            max_num_seqs=n, count_output_tokens=system.count_output_tokens, max_batched_tokens=None
        ),
        tenants=(system.tenant(),),
    )


def build(name: str, cluster: ClusterConfig, system: SystemConfig | None = None):
    check_choice("system", name, SYSTEMS)
    system = system or SystemConfig()
    if name == "static":
        return StaticBatchingSimulator(cluster)
    if name == "bucketserve":
        manager = BucketManager(bucket_manager_config(cluster, system))
        return Simulator(
            name,
            cluster,
            manager,
            system.pad or "shape",
            system.count_output_tokens,
            tenant=system.tenant().name,
            prefix_caching=system.prefix_caching,
            cache_aware=system.cache_aware,
            max_batches_per_prefill=system.max_batches_per_prefill,
            remote_prefill=system.remote_prefill,
            layerwise=system.layerwise,
        )
    batcher = FcfsBatcher(
        cluster.max_num_seqs, cluster.model_spec.max_len, system.fcfs_max_batched_tokens
    )
    return Simulator(
        name,
        cluster,
        batcher,
        system.pad or "longest",
        commits_output=False,
        prefix_caching=system.prefix_caching,
        cache_aware=system.cache_aware,
        max_batches_per_prefill=system.max_batches_per_prefill,
    )


def simulate(
    name: str,
    cluster: ClusterConfig,
    requests: list[SimRequest],
    system: SystemConfig | None = None,
) -> RunResult:
    return build(name, cluster, system).run(requests)
