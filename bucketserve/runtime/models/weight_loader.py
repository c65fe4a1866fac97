"""Filling a model's parameters from Hugging Face-named checkpoint tensors."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import torch
from torch import nn

from bucketserve.runtime.io.quantized import QuantizedTensor

# checkpoint name fragment -> (the fragment of the parameter it is stacked into, shard index)
StackedParams = Mapping[str, tuple[str, int]]


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]],
    stacked_params: StackedParams,
    skip: Collection[str] = (),
) -> None:
    """Copy each tensor into the parameter of its name, a stacked one's shards (q, k, v
    into qkv) into their rows (`Linear.shard_rows`), through the owning module's
    `weight_loader(param, tensor)` where it has one; the names in `skip` and rotary tables
    are passed over. Every parameter, every shard of a stacked one, must be covered. A
    tensor-parallel module cuts its rank's slice first (`shard_tensor(leaf, tensor,
    shard)`). A weight kept in quantized blocks goes to its module's `load_blocks(tensor,
    shard)`, which keeps the blocks in place of the float parameter."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or name in skip:
            continue
        target, shard = _target(name, stacked_params)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        owner_name, _, leaf = target.rpartition(".")
        owner = modules[owner_name]
        dest = params[target].data
        if isinstance(tensor, QuantizedTensor):
            _load_blocks(owner, target, tensor, shard)
            loaded.add(f"{target}#{shard}")
            continue
        shard_tensor = getattr(owner, "shard_tensor", None)
        if shard_tensor is not None:  # a tensor-parallel layer: this rank's slice
            tensor = shard_tensor(leaf, tensor, shard)
        if shard is not None:
            dest = dest.narrow(0, *owner.shard_rows(shard))
        if dest.shape != tensor.shape:
            raise ValueError(
                f"weight for {target!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)}"
            )
        loader = getattr(owner, "weight_loader", None)
        if loader is not None:
            loader(dest, tensor)
        else:
            dest.copy_(tensor)
        loaded.add(f"{target}#{shard}")
    expected = set()
    for name in params:
        shards = [s for fused, s in stacked_params.values() if fused in name]
        expected |= {f"{name}#{s}" for s in shards or [None]}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks weights for {missing[:5]} ({len(missing)} missing)")


def _load_blocks(
    owner: nn.Module, target: str, tensor: QuantizedTensor, shard: int | None
) -> None:
    load_blocks = getattr(owner, "load_blocks", None)
    if load_blocks is None or getattr(owner, "tp", None) is not None:
        raise ValueError(
            f"{target!r} cannot keep quantized blocks here; load the model with "
            f"quantization 'none' (weights expanded to float32)"
        )
    load_blocks(tensor, shard)


def _target(name: str, stacked_params: StackedParams) -> tuple[str, int | None]:
    for fragment, (fused, shard) in stacked_params.items():
        if fragment in name:
            return name.replace(fragment, fused), shard
    return name, None
