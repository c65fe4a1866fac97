"""The simulated cluster: which model on which accelerators, how many of each role."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.simulator.cost_model import CostModel
from benchmarks.simulator.hardware import HARDWARE, LINKS, HardwareSpec, LinkSpec, lookup
from benchmarks.simulator.model_spec import MODELS, ModelSpec
from bucketserve.utils.checks import check_int


@dataclass(frozen=True)
class ClusterConfig:
    """`num_prefill` + `num_decode` accelerators (the aggregated baseline runs a replica on
    each). `max_num_seqs` caps a decode worker's running batch and a prefill batch alike.
    Every worker (and replica) is `tp` accelerators in tensor parallel over `tp_link`,
    times `pp` pipeline stages whose hidden states cross `pp_link`.
    `hardware_spec` overrides the named hardware (the calibrated CPU); `kv_blocks` the
    KV pool each worker derives from its memory (small pools in tests)."""

    model: str = "llama-2-13b"
    hardware: str = "a100-40gb"
    link: str = "nvlink3"
    num_prefill: int = 1
    num_decode: int = 3
    block_size: int = 16
    max_num_seqs: int = 128
    tp: int = 1
    tp_link: str = "nvlink3"
    pp: int = 1
    pp_link: str = "nvlink3"
    kv_blocks: int | None = None
    hardware_spec: HardwareSpec | None = None

    def __post_init__(self) -> None:
        lookup(MODELS, "model", self.model)
        lookup(LINKS, "link", self.link)
        lookup(LINKS, "tp_link", self.tp_link)
        lookup(LINKS, "pp_link", self.pp_link)
        if self.hardware_spec is None:
            lookup(HARDWARE, "hardware", self.hardware)
        check_int("ClusterConfig.num_prefill", self.num_prefill, 1)
        check_int("ClusterConfig.num_decode", self.num_decode, 1)
        check_int("ClusterConfig.block_size", self.block_size, 1)
        check_int("ClusterConfig.max_num_seqs", self.max_num_seqs, 1)
        check_int("ClusterConfig.tp", self.tp, 1)
        check_int("ClusterConfig.pp", self.pp, 1)
        if self.kv_blocks is not None:
            check_int("ClusterConfig.kv_blocks", self.kv_blocks, 1)

    @property
    def model_spec(self) -> ModelSpec:
        return MODELS[self.model]

    @property
    def link_spec(self) -> LinkSpec:
        return LINKS[self.link]

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def num_accelerators(self) -> int:
        return self.num_workers * self.tp * self.pp

    def cost_model(self) -> CostModel:
        hardware = self.hardware_spec or HARDWARE[self.hardware]
        return CostModel(
            self.model_spec, hardware, self.tp, LINKS[self.tp_link], self.pp, LINKS[self.pp_link]
        )

    def num_kv_blocks(self) -> int:
        return self.kv_blocks or self.cost_model().num_kv_blocks(self.block_size)
