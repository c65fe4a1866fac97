"""The service YAML's keys: where each one lands in the typed configs, and the walk that
rejects unknown keys and wrong types naming the key path.

The typed configs (ModelRunnerConfig, ControllerConfig, GatewayConfig, ...) stay the one
source of truth for defaults and allowed values; this table only says which YAML key feeds
which of their fields, and takes each field's type from its annotation.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Union

from bucketserve.bucket_manager.config import BatchingConfig, RequestBucketConfig
from bucketserve.controller.config import ControllerConfig, PlacementConfig
from bucketserve.deploy.serve_config_error import ServeConfigError
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.runtime.core.scheduler import SchedulerConfig
from bucketserve.runtime.worker.model_runner import ModelRunnerConfig

TARGETS: dict[str, type] = {
    "runner": ModelRunnerConfig,
    "scheduler": SchedulerConfig,
    "prefill_placement": PlacementConfig,
    "decode_placement": PlacementConfig,
    "controller": ControllerConfig,
    "gateway": GatewayConfig,
    "request_buckets": RequestBucketConfig,
    "batching": BatchingConfig,
}
_PLACEMENT = (
    "accelerator", "num_cpus", "resources", "torch_threads", "cpus", "pipeline_parallel_size",
    "stage_packing", "execution",
)
_CONTROLLER = (
    "shape", "mode", "ray_address", "transport", "max_restarts", "lease_ttl_s",
    "worker_timeout_s", "max_queued_requests", "max_requeues", "stats_interval_s",
    "pad_to_shape_buckets", "warmup", "placement_timeout_s",
)


def _fields() -> dict[str, tuple[str, str]]:
    table = {
        "model.path": ("runner", "model"),
        "model.dtype": ("runner", "dtype"),
        "model.device": ("runner", "device"),
        "model.max_model_len": ("runner", "max_model_len"),
        "model.seed": ("runner", "seed"),
        "model.execution": ("runner", "execution"),
        "kv_cache.block_size": ("runner", "block_size"),
        "kv_cache.memory_fraction": ("runner", "kv_memory_fraction"),
        "kv_cache.num_blocks": ("runner", "num_kv_blocks"),
        "kv_cache.cpu_bytes": ("runner", "cpu_kv_cache_bytes"),
        "controller.prefill.num_workers": ("controller", "num_prefill"),
        "controller.prefill.kv_blocks": ("controller", "prefill_kv_blocks"),
        "controller.prefill.max_batches": ("controller", "max_batches_per_prefill"),
        "controller.decode.num_workers": ("controller", "num_decode"),
        "controller.decode.pipeline_depth": ("controller", "pipeline_depth"),
        "controller.decode.pace": ("controller", "decode_pace"),
    }
    table |= {f"controller.{name}": ("controller", name) for name in _CONTROLLER}
    for role in ("prefill", "decode"):
        table |= {f"controller.{role}.{n}": (f"{role}_placement", n) for n in _PLACEMENT}
    for f in dataclasses.fields(SchedulerConfig):
        table[f"controller.decode.{f.name}"] = ("scheduler", f.name)
    for name in ("max_len", "theta", "max_buckets", "shape_edge_snap", "lookup"):
        table[f"buckets.{name}"] = ("request_buckets", name)
    for f in dataclasses.fields(BatchingConfig):
        table[f"buckets.batching.{f.name}"] = ("batching", f.name)
    for f in dataclasses.fields(GatewayConfig):
        table[f"gateway.{f.name}"] = ("gateway", f.name)
    return table


# YAML key path -> (target config, its field)
FIELDS: dict[str, tuple[str, str]] = _fields()
# keys the loader builds itself (they have schemas of their own)
OWN_KEYS = (
    "buckets.strategy", "buckets.file", "buckets.prompt", "buckets.decode", "tenants",
    "cluster.resources",
)
# keys where null means "derive it" (L_max: the model's length), not a value
NULL_IS_UNSET = frozenset({"buckets.max_len"})
LEAVES = frozenset(FIELDS) | frozenset(OWN_KEYS)
SECTIONS = frozenset(
    ".".join(path.split(".")[:i]) for path in LEAVES for i in range(1, path.count(".") + 1)
)


class ServeConfigSchema:
    """Walks a parsed YAML mapping: every key known, every typed value of its field's type.
    `kwargs()` groups the values by target config; `paths()` gives their key paths."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.values: dict[str, Any] = {}
        self._walk(data, "")
        for path, value in self.values.items():
            if path in FIELDS:
                target, name = FIELDS[path]
                check_type(path, value, field_type(TARGETS[target], name))

    def _walk(self, data: dict[str, Any], prefix: str) -> None:
        for key, value in data.items():
            path = f"{prefix}{key}"
            if path in LEAVES:
                if value is not None or path not in NULL_IS_UNSET:
                    self.values[path] = value
            elif path in SECTIONS:
                if value is None:
                    continue
                if not isinstance(value, dict):
                    raise ServeConfigError(path, f"must be a mapping, got {_kind(value)}")
                self._walk(value, f"{path}.")
            else:
                raise ServeConfigError(path, unknown_key_message(path))

    def kwargs(self, target: str) -> dict[str, Any]:
        return {FIELDS[p][1]: self.values[p] for p in self.paths(target)}

    def paths(self, target: str) -> list[str]:
        return [p for p in self.values if p in FIELDS and FIELDS[p][0] == target]


def unknown_key_message(path: str) -> str:
    parent, _, key = path.rpartition(".")
    prefix = f"{parent}." if parent else ""
    allowed = sorted(
        {p[len(prefix):].split(".")[0] for p in LEAVES | SECTIONS if p.startswith(prefix)}
    )
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    where = f"under {parent}" if parent else "at the top level"
    return f"unknown key {key!r}{hint}; allowed {where}: {allowed}"


def field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def check_type(path: str, value: Any, hint: Any) -> None:
    if not _matches(value, hint):
        got = "null" if value is None else f"{_kind(value)} {value!r}"
        raise ServeConfigError(path, f"must be {describe(hint)}, got {got}")


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        return isinstance(value, dict) and all(
            _matches(k, key_type) and _matches(v, value_type) for k, v in value.items()
        )
    if origin is list:
        (item_type,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item_type) for v in value)
    return isinstance(value, hint)


def describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(h) for h in typing.get_args(hint))
    if origin is dict:
        return f"a mapping of names to {describe(typing.get_args(hint)[1]).split(' ', 1)[-1]}s"
    if origin is list:
        return f"a list of {describe(typing.get_args(hint)[0]).split(' ', 1)[-1]}s"
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a number",
             str: "a string", Any: "anything"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


_KINDS = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number",
          str: "a string", list: "a list", dict: "a mapping"}


def _kind(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)
