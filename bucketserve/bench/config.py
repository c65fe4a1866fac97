"""What one `bucketserve bench` run drives, with what load, judged against which SLO."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urlparse

from bucketserve.bench.slo import SLO
from bucketserve.bench.tenant_mix import TenantShare
from bucketserve.bench.workload import WorkloadConfig

BACKENDS = ("grpc", "openai")


@dataclass
class BenchConfig:
    """Open loop at each of `rates` (req/s), or a closed loop of `concurrency` clients when
    `rates` is empty. `metrics_url`: the server's Prometheus endpoint (None: not scraped).
    `model_path`: where the tokenizer comes from (None: the embedded default model)."""

    backend: str = "grpc"
    target: str = "127.0.0.1:50051"
    base_url: str = "http://127.0.0.1:8000/v1"
    served_model: str | None = None
    metrics_url: str | None = "http://127.0.0.1:8000/metrics"
    model_path: str | None = None
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    tenants: list[TenantShare] = field(default_factory=list)
    rates: list[float] = field(default_factory=lambda: [1.0])
    concurrency: int = 0
    duration_s: float | None = None
    slo: SLO = field(default_factory=lambda: SLO(ttft_s=2.0, tpot_s=0.2))
    timeout_s: float = 600.0
    allow_remote: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.rates and self.concurrency < 1:
            raise ValueError("give request rates (--rate / --rates) or --concurrency N >= 1")
        bad = [r for r in self.rates if not r > 0]
        if bad:
            raise ValueError(f"request rates must be > 0 req/s, got {bad}")
        if self.backend == "openai" and not self.served_model:
            raise ValueError("the openai backend needs --model NAME (the served model's name)")
        if not self.allow_remote:
            for address in (self.address, self.metrics_url):
                check_loopback(address)

    @property
    def address(self) -> str:
        return self.target if self.backend == "grpc" else self.base_url


def host_of(address: str) -> str:
    """The host of `host:port`, `[v6]:port` or a URL."""
    if "//" in address:
        return urlparse(address).hostname or ""
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
    if host.startswith("["):
        host = host[1 : host.index("]")]
    return host.removeprefix("ipv4:").removeprefix("ipv6:")


def check_loopback(address: str | None) -> None:
    """Refuses a target that is not this machine: the load generator floods what it points
    at, so another host needs an explicit --allow-remote."""
    if not address:
        return
    host = host_of(address)
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"cannot resolve the target host {host!r} of {address!r}: {exc}") from exc
    addresses = {info[4][0].split("%")[0] for info in infos}
    if not all(ipaddress.ip_address(a).is_loopback for a in addresses):
        raise ValueError(
            f"{address!r} is not a loopback address ({sorted(addresses)}): the load generator "
            "only drives this machine unless you pass --allow-remote"
        )
