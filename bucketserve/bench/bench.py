"""One benchmark: a workload swept over request rates (or a closed loop) against a target."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from bucketserve.bench.config import BenchConfig
from bucketserve.bench.load_runner import LoadRunner
from bucketserve.bench.metrics import summarize
from bucketserve.bench.request_record import RequestRecord
from bucketserve.bench.server_metrics import ServerMetrics
from bucketserve.bench.tenant_mix import TenantMix
from bucketserve.bench.workload import Workload, WorkloadGenerator


def load_tokenizer(model_path: str | None) -> Any:
    """The model's own tokenizer, so synthetic prompts have the lengths the server counts."""
    from bucketserve.runtime.io.tokenizer import Tokenizer
    from bucketserve.runtime.loader.model_files import resolve_model

    return Tokenizer.from_dir(resolve_model(model_path, keep_blocks=True))


class Bench:
    def __init__(self, config: BenchConfig, tokenizer: Any | None = None) -> None:
        self.config = config
        self.tenants = TenantMix(config.tenants or None)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_path)
        self.workloads: dict[int, Workload] = {}
        self.records: dict[float | None, list[RequestRecord]] = {}

    def make_workload(self, rate: float | None = None) -> Workload:
        """The prompts and arrivals offered at `rate`: the k-th rate of the sweep draws them
        with seed + k, so a later rate does not replay prompts the server's prefix cache
        already holds from an earlier one."""
        rates = self.config.rates or [None]
        k = rates.index(rate) if rate in rates else 0
        if k not in self.workloads:
            config = dataclasses.replace(self.config.workload, seed=self.config.workload.seed + k)
            self.workloads[k] = WorkloadGenerator(config, self.tokenizer, self.tenants).generate()
        return self.workloads[k]

    def run(self) -> dict[str, Any]:
        return self.result(self.run_rates(self.config.rates or [None])["runs"])

    def run_rates(self, rates: list[float | None]) -> dict[str, Any]:
        """The runs at these rates (None: the closed loop), without the config header."""
        return {"runs": asyncio.run(self._runs(rates))}

    def result(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        config = _jsonable(self.config)
        for tenant in config["tenants"]:
            tenant["api_key"] = tenant["api_key"] and "<redacted>"
        return {"config": config, "workload": self.make_workload().info, "runs": runs}

    async def _runs(self, rates: list[float | None]) -> list[dict[str, Any]]:
        backend = self._backend()
        try:
            return [await self._one(backend, rate) for rate in rates]
        finally:
            await backend.close()

    async def _one(self, backend: Any, rate: float | None) -> dict[str, Any]:
        workload = self.make_workload(rate)
        runner = LoadRunner(backend, self.config.duration_s, self.config.progress)
        server = ServerMetrics(self.config.metrics_url)
        server.start()
        if rate is None:
            records = await runner.closed_loop(workload.requests, self.config.concurrency)
        else:
            records = await runner.open_loop(workload.requests, rate, workload.info["seed"])
        self.records[rate] = records
        offered = _offered_rate(records) if rate is not None else None
        summary = summarize(records, self.config.slo, offered)
        return {
            "rate": rate,
            "seed": workload.info["seed"],
            "concurrency": self.config.concurrency if rate is None else None,
            "summary": summary.as_dict(),
            "server": server.delta(),
            "request_buckets_seen": _buckets_seen(records),
        }

    def _backend(self) -> Any:
        keys, timeout = self.tenants.keys(), self.config.timeout_s
        if self.config.backend == "grpc":
            from bucketserve.bench.grpc_backend import GrpcBackend

            return GrpcBackend(self.config.target, keys, timeout)
        from bucketserve.bench.openai_backend import OpenAIBackend

        return OpenAIBackend(self.config.base_url, self.config.served_model or "", keys, timeout)


def _offered_rate(records: list[RequestRecord]) -> float | None:
    """Requests per second the client actually sent (n - 1 gaps over the send span)."""
    sends = sorted(r.send_time for r in records)
    if len(sends) < 2 or sends[-1] <= sends[0]:
        return None
    return (len(sends) - 1) / (sends[-1] - sends[0])


def _buckets_seen(records: list[RequestRecord]) -> int:
    return len({tuple(r.request_bucket) for r in records if r.request_bucket})


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def write_json(data: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path
