"""The service config file (`bucketserve/deploy/serve.yaml`) turned into the configs the
service starts with: GatewayConfig, TenantRegistry and ControllerConfig.

Every error is a ServeConfigError naming the file, the key path and what is allowed.
`load` checks everything that needs no model files (`ServeSettings`, then the rules across
sections); `controller_config()` then reads the model's length (L_max checks, derived
shape buckets), which `bucketserve serve` needs anyway and `bucketserve config check` does
when the model is on this machine.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bucketserve.bucket_manager.config import (
    BatchingConfig,
    BucketManagerConfig,
    RequestBucketConfig,
    TenantConfig,
)
from bucketserve.controller.config import ControllerConfig
from bucketserve.controller.service_limits import ServiceLimits
from bucketserve.deploy.serve_config_error import ServeConfigError
from bucketserve.deploy.serve_settings import ServeSettings
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.gateway.tenant_registry import TenantRegistry
from bucketserve.runtime.io.tokenizer import load_chat_template
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from bucketserve.utils.settings import SettingsError

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
            return cls.from_settings(ServeSettings.parse(data), source, flags)
        except SettingsError as exc:
            raise ServeConfigError(exc.path, exc.message, flags.get(exc.path, source)) from None
        except ServeConfigError as exc:
            raise exc.at(flags.get(exc.path, source)) from None

    @classmethod
    def from_settings(
        cls, settings: ServeSettings, source: str = "<config>", flags: dict[str, str] | None = None
    ) -> ServeConfig:
        s, buckets = settings, settings.buckets
        try:
            tenants = TenantRegistry(s.tenants or ())
        except ValueError as exc:  # across tenants: names, keys
            raise ServeConfigError("tenants", str(exc)) from None
        runner = _runner(s)
        config = cls(
            source=source,
            gateway=s.gateway,
            tenants=tenants,
            controller=_controller(s, runner),
            request_buckets=buckets.request_buckets(),
            batching=buckets.batching,
            shape_buckets=buckets.shape_keys(),
            cluster_resources=dict(s.cluster.resources),
            flags=flags or {},
        )
        for role in ("prefill", "decode"):
            config._check_card(role)
        config._check_capacity()
        return config

    # -- checks across sections ---------------------------------------------------------------

    def _check_card(self, role: str) -> None:
        device = self.controller.runner.device.split(":")[0]
        needs = _CARD_DEVICES.get(device)
        accelerator = self.controller.placement(role).accelerator
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
        counts = {"prefill": c.num_prefill_workers, "decode": c.decode.num_workers}
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

    def actor_resources(self, role: str) -> dict[str, float]:
        """What one worker of `role` asks Ray for, as its placement group does: one card
        and `num_cpus` per rank of every stage, plus, with pipeline stages, the worker's
        own card-less bundle; `auto` picks the card kind cluster.resources names (HPU
        before GPU)."""
        placement = self.controller.placement(role)
        accelerator = placement.accelerator
        if accelerator == "auto":
            have = self.cluster_resources
            accelerator = "hpu" if have.get("HPU") else "gpu" if have.get("GPU") else "none"
        ranks = placement.tensor_parallel_size * placement.pipeline_parallel_size
        bundles = ranks + (placement.pipeline_parallel_size > 1)
        asks: dict[str, float] = {"CPU": placement.num_cpus * bundles, **placement.resources}
        if accelerator == "hpu":
            asks["HPU"] = ranks
        elif accelerator == "gpu":
            asks["GPU"] = ranks
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
            shape_buckets=base.shape_buckets.model_copy(update=shape),
            batching=self.batching,
        )
        config = self.controller.model_copy(update={"buckets": buckets})
        config = config.model_copy(
            update={"buckets": ServiceLimits.bucket_config(config, max_len)}
        )
        return with_tenants(config, self.tenants.bucket_configs())

    def model_len(self, convert: bool = True) -> int:
        """The longest sequence served: max_model_len (or L_max), at most the model's.
        `convert=False` reads a GGUF's metadata instead of converting it (and caching the
        conversion, which serving needs anyway)."""
        try:
            model = _model_config(self.controller.runner.model, convert)
        except ValueError as exc:
            raise self._error("model.path", str(exc)) from None
        self._check_tensor_parallel(model)
        try:
            return ServiceLimits.max_model_len(self.controller, model)
        except ValueError as exc:
            key = "buckets.max_len" if self.request_buckets.max_len else "model.max_model_len"
            raise self._error(key, str(exc)) from None

    def _check_tensor_parallel(self, model: Any) -> None:
        """The runtime's refusal of a model whose heads do not split over a role's ranks,
        at start rather than in each worker's model load."""
        from bucketserve.runtime.models.causal_lm import check_tensor_parallel

        roles = ("decode",) if self.controller.colocated else ("prefill", "decode")
        for role in roles:
            try:
                check_tensor_parallel(model, self.controller.placement(role).tensor_parallel_size)
            except ValueError as exc:
                raise self._error(f"controller.{role}.tensor_parallel_size", str(exc)) from None

    def _error(self, path: str, message: str) -> ServeConfigError:
        return ServeConfigError(path, message, self.flags.get(path, self.source))


def with_tenants(config: ControllerConfig, tenants: Sequence[TenantConfig]) -> ControllerConfig:
    """`config` whose bucket manager serves these tenants' policies. Without bucket settings
    these are the controller's defaults for the model (its derived request and shape
    buckets), which need the model's length."""
    from bucketserve.runtime.loader.model_files import resolve_model
    from bucketserve.runtime.models import load_model_config

    base = config.buckets
    if base is None:
        runner = config.runner
        keep = runner.quantization == "auto"
        model = load_model_config(resolve_model(runner.model, keep_blocks=keep))
        base = ServiceLimits.bucket_config(config, ServiceLimits.max_model_len(config, model))
    return config.model_copy(
        update={"buckets": dataclasses.replace(base, tenants=tuple(tenants))}
    )


def _model_config(model: str | None, convert: bool) -> Any:
    """The model's ModelConfig; without `convert` a GGUF file's (the embedded default's
    too) comes from its metadata, writing nothing."""
    from bucketserve.runtime.io.default_model import default_gguf_path
    from bucketserve.runtime.loader.gguf_converter import GGUFConverter
    from bucketserve.runtime.loader.model_files import resolve_model
    from bucketserve.runtime.models import load_model_config, parse_model_config

    path = default_gguf_path() if model is None else Path(model).expanduser()
    if not convert and path.suffix == ".gguf" and path.is_file():
        return parse_model_config(GGUFConverter(path).config_dict())
    return load_model_config(resolve_model(model, keep_blocks=True))


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


# -- builders: validated settings -> the service's dataclasses -----------------------------------


def _runner(s: ServeSettings) -> ModelRunnerConfig:
    runner = ModelRunnerConfig(**dict(s.model), **dict(s.kv_cache))
    template = s.model.chat_template
    return runner.model_copy(update={
        "max_model_len": s.buckets.max_len or s.model.max_model_len,  # L_max: the longest
        "chat_template": template and load_chat_template(template),
    })  # fmt: skip


def _controller(s: ServeSettings, runner: ModelRunnerConfig) -> ControllerConfig:
    """The file's controller section with the model runner the model and kv_cache sections
    make."""
    return s.controller.model_copy(update={"runner": runner})


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
