"""The paged KV pool: one K and one V tensor per layer."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

import torch


class KVCache:
    """Layout: per layer, `k[layer]` and `v[layer]`, each `[kv_head, block, slot_in_block,
    head_dim]` (`num_blocks + 1` blocks). Separate tensors, not views of one pool, so a
    compiled graph or HPU graph takes a layer's cache as its own input and writes it in
    place (as vllm-gaudi keeps them). Gathering a row's blocks gives each head its keys as one
    contiguous `[tokens, head_dim]` run, the layout SDPA's CPU kernel reads
    fastest. Export and import speak the wire layout of `kv_transfer`
    (`[K/V, block, slot, kv_head, head_dim]`), so pools need not share one.
    Block ids 0..num_blocks-1 belong to the block manager; the extra last
    block (`null_block`) is scratch: padding tokens write there and padded
    block-table entries point there, so fixed-shape steps need no
    data-dependent masking of writes.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_kv_heads, num_blocks + 1, block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def kv(self) -> torch.Tensor:
        """A stacked copy `[layer, K/V, kv_head, block, slot, head_dim]` (for inspection)."""
        return torch.stack([torch.stack(kv) for kv in zip(self.k, self.v, strict=True)])

    @property
    def null_block(self) -> int:
        return self.num_blocks

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across all layers, K and V."""
        return self.block_bytes(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    @staticmethod
    def block_bytes(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) views of one layer."""
        return self.k[layer], self.v[layer]

    def export_blocks(self, layer: int, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of one layer's blocks: `[2, len(block_ids), block_size, heads, head_dim]`."""
        self._check_layer(layer)
        index = self._index(block_ids)
        shape = (2, len(block_ids), *self.block_shape)
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        for i, cache in enumerate((self.k[layer], self.v[layer])):
            out[i].copy_(cache.index_select(1, index).permute(1, 2, 0, 3))
        return out

    def import_blocks(self, layer: int, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write `export_blocks`-shaped data into one layer's blocks (any dtype/device)."""
        self._check_layer(layer)
        index = self._index(block_ids, unique=True)
        self._check_data(data, (2, len(block_ids), *self.block_shape))
        data = data.to(self.device, self.dtype).permute(0, 3, 1, 2, 4)
        self.k[layer].index_copy_(1, index, data[0])
        self.v[layer].index_copy_(1, index, data[1])

    def export_all(self, block_ids: Sequence[int]) -> torch.Tensor:
        """All layers: `[num_layers, 2, len(block_ids), block_size, heads, head_dim]`."""
        return torch.stack([self.export_blocks(i, block_ids) for i in range(self.num_layers)])

    def import_all(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        index = self._index(block_ids, unique=True)
        self._check_data(data, (self.num_layers, 2, len(block_ids), *self.block_shape))
        data = data.to(self.device, self.dtype).permute(0, 1, 4, 2, 3, 5)
        for layer in range(self.num_layers):
            self.k[layer].index_copy_(1, index, data[layer, 0])
            self.v[layer].index_copy_(1, index, data[layer, 1])

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range; the pool has {self.num_layers} layers")

    def _index(self, block_ids: Sequence[int], unique: bool = False) -> torch.Tensor:
        ids = [int(b) if isinstance(b, Integral) else b for b in block_ids]
        bad = [b for b in ids if not isinstance(b, int) or not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:5]} out of range [0, {self.num_blocks})")
        if unique and len(set(ids)) != len(ids):
            raise ValueError("block ids to import must be distinct")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _check_data(self, data: torch.Tensor, shape: tuple[int, ...]) -> None:
        if not isinstance(data, torch.Tensor) or tuple(data.shape) != shape:
            got = tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__
            raise ValueError(f"KV data must have shape {shape}, got {got}")
        if not data.is_floating_point():
            raise ValueError(f"KV data must be a floating-point tensor, got {data.dtype}")
