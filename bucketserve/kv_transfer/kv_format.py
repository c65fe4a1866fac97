"""The KV wire format and the handle naming where one prefill batch's blocks land (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# One chunk is one layer of a batch's blocks: [K/V, block, slot in block, kv head, head dim].
CHUNK_LAYOUT = "kv,block,slot,kv_head,head_dim"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVFormat:
    """What a chunk of KV blocks is, so two pools on different devices can trade them.

    Shapes must agree (block size, layers, KV heads, head dim); dtype and
    device may differ and are converted on import, so a CPU or Gaudi prefill
    can feed a CUDA decode. A tensor-parallel rank's pool holds a shard: its
    `num_kv_heads` of the model's KV heads from `kv_head_offset` on, which must be
    the same heads on both sides.
    """

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = CHUNK_LAYOUT
    kv_head_offset: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KV dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.layout != CHUNK_LAYOUT:
            raise ValueError(f"unknown KV chunk layout {self.layout!r}; expected {CHUNK_LAYOUT!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVFormat.{name} must be a positive integer, got {value!r}")
        offset = self.kv_head_offset
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"KVFormat.kv_head_offset must be an integer >= 0, got {offset!r}")

    @classmethod
    def of(cls, kv_cache: Any, kv_head_offset: int = 0) -> KVFormat:
        """The format of a `bucketserve.runtime.worker.kv_cache.KVCache` pool (a
        tensor-parallel rank's: its heads start at the model's `kv_head_offset`)."""
        return cls(
            dtype=str(kv_cache.dtype).removeprefix("torch."),
            block_size=kv_cache.block_size,
            num_layers=kv_cache.num_layers,
            num_kv_heads=kv_cache.num_kv_heads,
            head_dim=kv_cache.head_dim,
            kv_head_offset=kv_head_offset,
        )

    def chunk_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def chunk_bytes(self, num_blocks: int) -> int:
        return 2 * num_blocks * self.block_size * self.num_kv_heads * self.head_dim * (
            DTYPE_BYTES[self.dtype]
        )

    def check_compatible(self, receiver: KVFormat) -> None:
        """Raise ValueError naming every shape field where this sender and `receiver` differ."""
        fields = (
            "block_size", "num_layers", "num_kv_heads", "head_dim", "layout", "kv_head_offset"
        )
        diff = [
            f"{f} {getattr(self, f)} vs {getattr(receiver, f)}"
            for f in fields
            if getattr(self, f) != getattr(receiver, f)
        ]
        if diff:
            raise ValueError(
                f"prefill and decode KV formats differ ({', '.join(diff)}); both workers must "
                "serve the same model with the same block_size and tensor_parallel_size (a "
                "rank's pool holds only its shard of the KV heads)"
            )


@dataclass(frozen=True)
class KVBlockHandle:
    """Where one prefill batch's KV lands: a decode worker's lease on reserved blocks.

    `block_ids[i]` are the blocks reserved for `request_ids[i]`, of which the first
    `num_cached_blocks[i]` already hold the K/V (the decode worker's prefix cache): only
    the others travel. A chunk carries the batch's travelling blocks in that order, so it
    is imported with `transfer_block_ids`.

    A tensor-parallel decode worker names each rank's pool format in `rank_formats` (rank
    0's is `format`; empty with one rank): prefill rank r ships its KV heads to decode rank
    r, under the same block ids (`for_rank`).
    """

    decode_worker: str
    lease_id: str
    request_ids: tuple[str, ...]
    block_ids: tuple[tuple[int, ...], ...]
    format: KVFormat
    num_cached_blocks: tuple[int, ...] = ()  # empty: none cached
    rank_formats: tuple[KVFormat, ...] = ()
    # where the sender may push each layer as it is computed (the decode worker's Ray actor,
    # for the object-store transport); None: the decode side pulls at admission
    receiver: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.request_ids) != len(self.block_ids) or not self.request_ids:
            raise ValueError(
                f"a KV handle needs one block list per request, got {len(self.request_ids)} "
                f"requests and {len(self.block_ids)} block lists"
            )
        cached = tuple(self.num_cached_blocks) or (0,) * len(self.block_ids)
        ok = len(cached) == len(self.block_ids) and all(
            isinstance(n, int) and 0 <= n < len(blocks)
            for n, blocks in zip(cached, self.block_ids, strict=True)
        )
        if not ok:  # the block holding a request's last token always travels
            raise ValueError(
                f"num_cached_blocks {self.num_cached_blocks} must leave each request at "
                "least one block to send"
            )
        object.__setattr__(self, "num_cached_blocks", cached)
        formats = tuple(self.rank_formats)
        if formats and formats[0] != self.format:
            raise ValueError("a KV handle's rank_formats must start with its own format")
        object.__setattr__(self, "rank_formats", formats)

    @property
    def num_ranks(self) -> int:
        """The decode worker's tensor-parallel ranks, each receiving its shard of the KV."""
        return max(1, len(self.rank_formats))

    def for_rank(self, rank: int) -> KVBlockHandle:
        """The handle as decode rank `rank` takes its shard: the same lease and blocks, that
        rank's pool format."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(
                f"decode worker {self.decode_worker} has {self.num_ranks} tensor-parallel "
                f"ranks, no rank {rank}"
            )
        if not self.rank_formats:
            return self
        receiver = self.receiver if rank == 0 else None  # a rank's own transport pulls
        return replace(self, format=self.rank_formats[rank], rank_formats=(), receiver=receiver)

    @property
    def flat_block_ids(self) -> list[int]:
        return [b for blocks in self.block_ids for b in blocks]

    @property
    def num_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.block_ids)

    @property
    def transfer_block_ids(self) -> list[int]:
        """The blocks whose K/V is sent, in chunk order."""
        return [
            b
            for blocks, cached in zip(self.block_ids, self.num_cached_blocks, strict=True)
            for b in blocks[cached:]
        ]

    @property
    def num_transfer_blocks(self) -> int:
        return self.num_blocks - sum(self.num_cached_blocks)
