"""The gateway's settings (the config file's `gateway` section): addresses, TLS, gRPC
transport limits, request limits, shutdown grace."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from bucketserve.runtime.core.sampling_params import MAX_LOGPROBS, MAX_N
from bucketserve.utils.settings import Settings, SettingsError

DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000


class BindError(OSError):
    """A front end could not bind its port; the message names the key and flag to change."""


class GatewayConfig(Settings):
    """Port 0 picks a free port (tests). `host` defaults to loopback because the embedded
    default needs no API key. Every list a request carries is counted against its limit
    before any of its elements is looked at (`RequestLimits`)."""

    host: str = Field("127.0.0.1", min_length=1)
    """Address to bind; 0.0.0.0 serves a network."""
    grpc_port: int = Field(DEFAULT_GRPC_PORT, ge=0, le=65535)
    """gRPC port (0: any free port)."""
    http_port: int | None = Field(DEFAULT_HTTP_PORT, ge=0, le=65535)
    """OpenAI API, /metrics and /health; null: gRPC only."""
    served_model_name: str | None = None
    """The model's name in the APIs; null: its path or the embedded model's name."""
    tls_cert_file: str | None = None
    """PEM certificate; TLS when given with tls_key_file."""
    tls_key_file: str | None = None
    """PEM private key."""
    max_message_bytes: int = Field(1024 * 1024, ge=1024)
    """Largest gRPC message or HTTP body, refused before it is parsed (gRPC
    RESOURCE_EXHAUSTED, HTTP 413)."""
    keepalive_time_s: float = Field(30.0, ge=1)
    """gRPC keepalive ping interval."""
    keepalive_timeout_s: float = Field(10.0, ge=0.1)
    """How long a keepalive ping may go unanswered."""
    drain_timeout_s: float = Field(30.0, ge=0)
    """On shutdown, how long running requests may finish before they are cancelled."""
    http_request_timeout_s: float | None = Field(600.0, ge=0.001)
    """One HTTP request, streaming included: 504 after it; null: no bound."""
    max_stop_strings: int = Field(64, ge=0)
    """Stop strings per request."""
    max_stop_chars: int = Field(4096, ge=0)
    """Total length of a request's stop strings, in characters."""
    max_stop_token_ids: int = Field(256, ge=0)
    """Stop token ids per request."""
    max_prompt_chars: int = Field(1_000_000, ge=1)
    """Characters of text one request has tokenized (a prompt, a chat's message contents
    together, a /tokenize input), refused before tokenizing."""
    max_chat_messages: int = Field(4096, ge=1)
    """Messages of one chat request (and text parts of one message's content)."""
    max_logit_bias: int = Field(1024, ge=0)
    """Entries of one request's logit_bias."""
    max_tools: int = Field(128, ge=0)
    """Tools of one chat request (each one's schema reaches the chat template and, with
    tool_choice required or named, the grammar)."""
    max_logprobs: int = Field(MAX_LOGPROBS, ge=0, le=MAX_LOGPROBS)
    """Top logprobs per token a request may ask for (logprobs, top_logprobs,
    prompt_logprobs; vLLM's max_logprobs)."""
    max_n: int = Field(MAX_N, ge=1, le=MAX_N)
    """Samples (choices) of one request."""
    grpc_stream_idle_timeout_s: float | None = Field(60.0, gt=0)
    """A gRPC response the client has not taken after this long (it stopped reading) ends
    the stream and aborts the request, freeing its tenant's concurrency slot, deadline or
    not; null: a stalled client may hold it forever."""
    metrics_auth: bool = False
    """/metrics needs one of the tenants' keys (`authorization: Bearer <key>`), as
    generation does. Off by default: the keyless embedded default has no key to give. With
    tenants configured /metrics names them and their usage: turn it on once the HTTP port
    is reachable beyond the machine (the gateway warns at start when it is not)."""
    tokenizer_threads: int = Field(2, ge=1)
    """Threads that tokenize and render chat templates, off the event loop."""
    log_prompts: bool = False
    """Prompt text in the access log."""

    @model_validator(mode="after")
    def _ports_and_tls(self) -> GatewayConfig:
        if self.http_port is not None and self.http_port == self.grpc_port != 0:
            raise SettingsError(
                "http_port", f"must differ from gateway.grpc_port ({self.grpc_port})"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise SettingsError(
                "tls_cert_file", "gateway.tls_cert_file and gateway.tls_key_file go together"
            )
        for name in ("tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise SettingsError(name, f"{path} is not a file")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None
