"""The gateway's settings: addresses, TLS, gRPC transport limits, shutdown grace."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bucketserve.bucket_manager.config import check_int, check_number

DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000


class BindError(OSError):
    """A front end could not bind its port; the message names the key and flag to change."""


@dataclass(frozen=True)
class GatewayConfig:
    """Port 0 picks a free port (tests); `http_port=None` serves gRPC only.

    `host` defaults to loopback because the embedded default needs no API key;
    pass "0.0.0.0" to serve a network. TLS is on when both `tls_cert_file` and
    `tls_key_file` are given (PEM). Keepalive pings let idle-looking long
    generations live through proxies; `drain_timeout_s` is how long shutdown
    lets running requests finish before cancelling them.

    `http_request_timeout_s` bounds one HTTP request, streaming included (504 after it;
    None: no bound); gRPC callers set their own deadline. `max_stop_strings` and
    `max_stop_chars` bound a request's stop strings, whose matching costs work on every
    token, and `max_stop_token_ids` its stop token ids, checked on every token too.
    `tokenizer_threads` tokenize and render chat templates off the event loop.
    `log_prompts` puts prompt text in the access log (off: it may be private).
    """

    host: str = "127.0.0.1"
    grpc_port: int = DEFAULT_GRPC_PORT
    http_port: int | None = DEFAULT_HTTP_PORT
    served_model_name: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    max_message_bytes: int = 16 * 1024 * 1024
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    drain_timeout_s: float = 30.0
    http_request_timeout_s: float | None = 600.0
    max_stop_strings: int = 64
    max_stop_chars: int = 4096
    max_stop_token_ids: int = 256
    tokenizer_threads: int = 2
    log_prompts: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"gateway.host must be a host name or address, got {self.host!r}")
        check_int("gateway.grpc_port", self.grpc_port, 0)
        if self.http_port is not None:
            check_int("gateway.http_port", self.http_port, 0)
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if port is not None and port > 65535:
                raise ValueError(f"gateway.{name} must be at most 65535, got {port}")
        check_int("gateway.max_message_bytes", self.max_message_bytes, 1024)
        check_number("gateway.keepalive_time_s", self.keepalive_time_s, 1.0)
        check_number("gateway.keepalive_timeout_s", self.keepalive_timeout_s, 0.1)
        check_number("gateway.drain_timeout_s", self.drain_timeout_s, 0.0)
        if self.http_request_timeout_s is not None:
            check_number("gateway.http_request_timeout_s", self.http_request_timeout_s, 0.001)
        check_int("gateway.max_stop_strings", self.max_stop_strings, 0)
        check_int("gateway.max_stop_chars", self.max_stop_chars, 0)
        check_int("gateway.max_stop_token_ids", self.max_stop_token_ids, 0)
        check_int("gateway.tokenizer_threads", self.tokenizer_threads, 1)
        if not isinstance(self.log_prompts, bool):
            raise ValueError(f"gateway.log_prompts must be true or false, got {self.log_prompts!r}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("gateway.tls_cert_file and gateway.tls_key_file go together")
        for name in ("tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"gateway.{name}: {path} is not a file")

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @classmethod
    def from_dict(cls, data: Any, where: str = "gateway") -> GatewayConfig:
        return cls(**known_keys(cls, data or {}, where))


def known_keys(cls: type, data: Any, where: str) -> dict[str, Any]:
    """`data` as keyword arguments of dataclass `cls`; ValueError naming unknown keys."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed keys are {sorted(known)}")
    return dict(data)
