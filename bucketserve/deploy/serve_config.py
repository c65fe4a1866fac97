"""The service YAML (`bucketserve/deploy/serve.yaml`) loaded into the typed configs the service
starts
with: GatewayConfig, TenantRegistry and ControllerConfig.

Every error is a ServeConfigError naming the file, the key path and what is allowed.
`load` checks everything that needs no model files; `controller_config()` then reads the
model's length (L_max checks, derived shape buckets), which `bucketserve serve` needs anyway
and `bucketserve config check` does when the model is on this machine.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bucketserve.bucket_manager.config import (
    BatchingConfig,
    BucketManagerConfig,
    RequestBucketConfig,
    ShapeBucketConfig,
    TenantConfig,
)
from bucketserve.controller.config import ControllerConfig, PlacementConfig
from bucketserve.controller.service_limits import ServiceLimits
from bucketserve.deploy.serve_config_error import ServeConfigError
from bucketserve.deploy.serve_config_schema import FIELDS, TARGETS, ServeConfigSchema, check_type
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.gateway.tenant_registry import TenantRegistry
from bucketserve.runtime.worker.device import DTYPES

DEVICES = ("auto", "cpu", "cuda", "cuda:<i>", "hpu")
_CARD_DEVICES = {"hpu": "hpu", "cuda": "gpu"}  # model.device -> the card its workers need


@dataclass(frozen=True)
class ServeConfig:
    """A validated service config. `controller` has no buckets yet: `controller_config()`
    derives them from the model and adds the tenants."""

    source: str
    gateway: GatewayConfig
    tenants: TenantRegistry
    controller: ControllerConfig
    request_buckets: RequestBucketConfig
    batching: BatchingConfig
    shape_buckets: dict[str, Any]  # strategy, file, prompt, decode as given (validated)
    max_len: int | None = None  # L_max as given
    cluster_resources: dict[str, float] = field(default_factory=dict)
    flags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(
        cls, path: str | Path | None, overrides: Mapping[str, tuple[Any, str]] | None = None
    ) -> ServeConfig:
        """The file (None: the embedded default), then `overrides` ({key path: (value,
        flag)}, from the command line) over it."""
        data = read_yaml(path) if path is not None else {}
        source = str(path) if path is not None else "<defaults>"
        flags = {}
        for key, (value, flag) in (overrides or {}).items():
            _set(data, key, value)
            flags[key] = flag
        if (overrides or {}).get("controller.mode", (None,))[0] == "local":
            data["controller"].pop("ray_address", None)  # --local wins over the file's Ray
        return cls.from_dict(data, source, flags)

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], source: str = "<config>", flags: dict[str, str] | None = None
    ) -> ServeConfig:
        flags = flags or {}
        try:
            return cls._build(ServeConfigSchema(data), source, flags)
        except ServeConfigError as exc:
            raise exc.at(flags.get(exc.path, source)) from None

    @classmethod
    def _build(cls, schema: ServeConfigSchema, source: str, flags: dict[str, str]) -> ServeConfig:
        values = schema.values
        max_len = values.get("buckets.max_len")  # L_max
        built = {
            t: _construct(schema, t)
            for t in ("request_buckets", "scheduler", "prefill_placement", "decode_placement",
                      "gateway", "batching")
        }
        built["runner"] = _construct(schema, "runner", _runner_len(schema, max_len))
        nested = {k: built[k] for k in _CONTROLLER_SECTIONS}
        controller = _construct(schema, "controller", nested)
        config = cls(
            source=source,
            gateway=built["gateway"],
            tenants=_tenants(values.get("tenants")),
            controller=controller,
            request_buckets=built["request_buckets"],
            batching=built["batching"],
            shape_buckets=_shape_buckets(values, controller.runner.block_size),
            max_len=max_len,
            cluster_resources=_cluster_resources(values.get("cluster.resources")),
            flags=flags,
        )
        config._check_consistent()
        return config

    # -- checks across sections ---------------------------------------------------------------

    def _check_consistent(self) -> None:
        c, g = self.controller, self.gateway
        if self.request_buckets.theta <= 0:
            theta = self.request_buckets.theta
            raise ServeConfigError("buckets.theta", f"θ must be in (0, 1], got {theta}")
        if g.http_port is not None and g.http_port == g.grpc_port != 0:
            raise ServeConfigError(
                "gateway.http_port", f"must differ from gateway.grpc_port ({g.grpc_port})"
            )
        if c.mode == "local" and c.ray_address is not None:
            raise ServeConfigError(
                "controller.ray_address",
                "mode 'local' runs every worker in this process without Ray; remove "
                "ray_address or set controller.mode to 'ray'",
            )
        _check_device(c.runner.device)
        if c.runner.dtype != "auto" and c.runner.dtype not in DTYPES:
            raise ServeConfigError(
                "model.dtype", f"must be 'auto' or one of {sorted(DTYPES)}; got {c.runner.dtype!r}"
            )
        for role in ("prefill", "decode"):
            self._check_card(role)
        self._check_capacity()

    def _check_card(self, role: str) -> None:
        device = self.controller.runner.device.split(":")[0]
        needs = _CARD_DEVICES.get(device)
        accelerator = self.placement(role).accelerator
        if needs and accelerator not in ("auto", needs):
            raise ServeConfigError(
                f"controller.{role}.accelerator",
                f"model.device {device!r} runs on {needs!r} cards, so accelerator must be "
                f"'auto' or {needs!r}; got {accelerator!r}",
            )

    def _check_capacity(self) -> None:
        """More workers than the cards (or any resource) cluster.resources names is an error."""
        if not self.cluster_resources:
            return
        asks = {role: self.actor_resources(role) for role in ("prefill", "decode")}
        c = self.controller
        counts = {"prefill": c.num_prefill_workers, "decode": c.num_decode}
        for name, have in self.cluster_resources.items():
            want = {role: asks[role].get(name, 0) * counts[role] for role in asks}
            if sum(want.values()) <= have:
                continue
            role = "prefill" if want["prefill"] > have else "decode"
            per = asks[role].get(name, 0)
            room = int((have - (0 if role == "prefill" else want["prefill"])) // per)
            raise ServeConfigError(
                f"controller.{role}.num_workers",
                f"{counts['prefill']} prefill + {counts['decode']} decode workers need "
                f"{_num(sum(want.values()))} {name} but cluster.resources.{name} is "
                f"{_num(have)}; allowed here: at most {max(room, 0)} {role} workers "
                f"(or add {name} to the cluster)",
            )

    # -- views --------------------------------------------------------------------------------

    def placement(self, role: str) -> PlacementConfig:
        c = self.controller
        return c.prefill_placement if role == "prefill" else c.decode_placement

    def actor_resources(self, role: str) -> dict[str, float]:
        """What one actor of `role` asks Ray for, as Launcher.actor_options does; `auto` picks
        the card kind cluster.resources names (HPU before GPU)."""
        placement = self.placement(role)
        accelerator = placement.accelerator
        if accelerator == "auto":
            have = self.cluster_resources
            accelerator = "hpu" if have.get("HPU") else "gpu" if have.get("GPU") else "none"
        asks: dict[str, float] = {"CPU": placement.num_cpus, **placement.resources}
        if accelerator == "hpu":
            asks["HPU"] = 1
        elif accelerator == "gpu":
            asks["GPU"] = 1
        return {k: v for k, v in asks.items() if v}

    def model_is_local(self) -> bool:
        model = self.controller.runner.model
        return model is None or Path(model).expanduser().exists()

    # -- what the service starts with ---------------------------------------------------------

    def controller_config(self, max_len: int | None = None) -> ControllerConfig:
        """The ControllerConfig with request and shape buckets for the model and the
        tenants' policies. Reads the model's length unless `max_len` is given
        (ServeConfigError when L_max or max_model_len exceed it, or a named file is missing)."""
        max_len = max_len or self.model_len()
        shape = self.shape_buckets
        bucket_file = shape.get("file")
        if shape.get("strategy") == "file" and bucket_file and not Path(bucket_file).is_file():
            raise self._error("buckets.file", f"{bucket_file} is not a file")
        base = ServiceLimits.bucket_config(self.controller, max_len)  # the derived defaults
        buckets = BucketManagerConfig(
            request_buckets=self.request_buckets,
            shape_buckets=dataclasses.replace(base.shape_buckets, **shape),
            batching=self.batching,
        )
        config = dataclasses.replace(self.controller, buckets=buckets)
        config = dataclasses.replace(config, buckets=ServiceLimits.bucket_config(config, max_len))
        return with_tenants(config, self.tenants.bucket_configs())

    def model_len(self, convert: bool = True) -> int:
        """The longest sequence served: max_model_len (or L_max), at most the model's.
        `convert=False` reads a GGUF's metadata instead of converting it (and caching the
        conversion, which serving needs anyway)."""
        try:
            model = _model_config(self.controller.runner.model, convert)
        except ValueError as exc:
            raise self._error("model.path", str(exc)) from None
        try:
            return ServiceLimits.max_model_len(self.controller, model)
        except ValueError as exc:
            key = "buckets.max_len" if self.max_len is not None else "model.max_model_len"
            raise self._error(key, str(exc)) from None

    def _error(self, path: str, message: str) -> ServeConfigError:
        return ServeConfigError(path, message, self.flags.get(path, self.source))



def with_tenants(config: ControllerConfig, tenants: Sequence[TenantConfig]) -> ControllerConfig:
    """`config` whose bucket manager serves these tenants' policies. Without bucket settings
    these are the controller's defaults for the model (its derived request and shape
    buckets), which need the model's length."""
    from bucketserve.runtime.io.model_config import ModelConfig
    from bucketserve.runtime.io.weights import resolve_model

    base = config.buckets
    if base is None:
        model = ModelConfig.from_dir(resolve_model(config.runner.model))
        base = ServiceLimits.bucket_config(config, ServiceLimits.max_model_len(config, model))
    return dataclasses.replace(config, buckets=dataclasses.replace(base, tenants=tuple(tenants)))


def _model_config(model: str | None, convert: bool) -> Any:
    """The model's ModelConfig; without `convert` a GGUF file's (the embedded default's
    too) comes from its metadata, writing nothing."""
    from bucketserve.runtime.io.default_model import default_gguf_path
    from bucketserve.runtime.io.gguf_converter import GGUFConverter
    from bucketserve.runtime.io.model_config import ModelConfig
    from bucketserve.runtime.io.weights import resolve_model

    path = default_gguf_path() if model is None else Path(model).expanduser()
    if not convert and path.suffix == ".gguf" and path.is_file():
        return ModelConfig.from_dict(GGUFConverter(path).config_dict())
    return ModelConfig.from_dir(resolve_model(model))


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        with Path(path).open() as stream:
            data = yaml.safe_load(stream)  # its marks name the file
    except OSError as exc:
        raise ServeConfigError("", f"cannot read the file: {exc.strerror}", str(path)) from None
    except yaml.YAMLError as exc:
        raise ServeConfigError("", f"not valid YAML: {exc}", str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ServeConfigError("", "must be a mapping of sections", str(path))
    return data


# -- builders -----------------------------------------------------------------------------------


_CONTROLLER_SECTIONS = ("runner", "scheduler", "prefill_placement", "decode_placement")


def _construct(schema: ServeConfigSchema, target: str, extra: dict[str, Any] | None = None) -> Any:
    """TARGETS[target] from its keys' values over its defaults: a section of the controller
    starts from ControllerConfig's (its decode engines schedule by priority, the offline
    engine's SchedulerConfig by FCFS). A ValueError from the config's own validation is
    pinned to the key whose value alone fails it, else to the section."""
    cls, kwargs = TARGETS[target], schema.kwargs(target)
    make = cls
    if target in _CONTROLLER_SECTIONS:
        make = functools.partial(dataclasses.replace, getattr(ControllerConfig(), target))
    try:
        return make(**kwargs, **(extra or {}))
    except (ValueError, TypeError) as exc:
        for path in schema.paths(target):
            name = FIELDS[path][1]
            try:
                cls(**{name: kwargs[name]})
            except (ValueError, TypeError) as single:
                raise ServeConfigError(path, _without_subject(str(single), name)) from None
        paths = schema.paths(target)
        section = _common_prefix(paths) if paths else target
        raise ServeConfigError(section, str(exc)) from None


def _without_subject(message: str, name: str) -> str:
    """"ControllerConfig.num_prefill must be ..." -> "must be ...": the key path says which."""
    return re.sub(rf"^[\w.]*\b{re.escape(name)}:? (?=must )", "", message)


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".")[:-1] for p in paths]
    common = parts[0]
    for other in parts[1:]:
        while other[: len(common)] != common:
            common = common[:-1]
    return ".".join(common)


def _runner_len(schema: ServeConfigSchema, max_len: int | None) -> dict[str, Any]:
    """L_max is the longest request served, so it sets the runner's max_model_len."""
    if max_len is None:
        return {}
    given = schema.values.get("model.max_model_len")
    if given is not None and given != max_len:
        raise ServeConfigError(
            "buckets.max_len",
            f"L_max {max_len} differs from model.max_model_len {given}; both bound the "
            "longest request: give one of them (or equal values)",
        )
    schema.values.pop("model.max_model_len", None)
    return {"max_model_len": max_len}


def _tenants(data: Any) -> TenantRegistry:
    try:
        return TenantRegistry.from_dict(data, "tenants")
    except ValueError as exc:
        found = re.match(r"(tenants(?:\[\d+\]|\.[^:\s]+)?): (.*)", str(exc), re.DOTALL)
        path, message = found.groups() if found else ("tenants", str(exc))
        raise ServeConfigError(path, message) from None


def _shape_buckets(values: dict[str, Any], block_size: int) -> dict[str, Any]:
    """The given shape-bucket keys, checked by ShapeBucketConfig itself (with the prompt and
    decode ranges the model derives standing in for any not given)."""
    given = {k: values[f"buckets.{k}"] for k in ("strategy", "file", "prompt", "decode")
             if values.get(f"buckets.{k}") is not None}
    for key in ("strategy", "file"):
        if key in given:
            check_type(f"buckets.{key}", given[key], str)
    try:
        shapes = ShapeBucketConfig.from_dict({**given, "block_size": block_size}, "buckets")
    except ValueError as exc:
        message = str(exc)
        match = re.search(r"\b(?:buckets\.)?((?:prompt|decode)(?:\.\w+)*)", message)
        key = next((k for k in ("strategy", "file") if f"ShapeBucketConfig.{k} " in message), None)
        path = f"buckets.{key}" if key else f"buckets.{match.group(1)}" if match else "buckets"
        raise ServeConfigError(path, message) from None
    return {k: getattr(shapes, k) for k in given}


def _cluster_resources(data: Any) -> dict[str, float]:
    if data is None:
        return {}
    check_type("cluster.resources", data, dict[str, float])
    for name, amount in data.items():
        if amount < 0:
            raise ServeConfigError(f"cluster.resources.{name}", f"must be >= 0, got {amount}")
    return dict(data)


def _check_device(device: str) -> None:
    name = device.strip().lower()
    if name in ("auto", "cpu", "cuda", "hpu") or re.fullmatch(r"cuda:\d+", name):
        return
    raise ServeConfigError("model.device", f"must be one of {list(DEVICES)}; got {device!r}")


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = data
    for key in parents:
        child = node.get(key)
        node[key] = child = copy.copy(child) if isinstance(child, dict) else {}
        node = child
    node[last] = value


def _num(value: float) -> str:
    return f"{value:g}"

