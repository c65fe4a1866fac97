"""The gateway's settings: addresses, TLS, gRPC transport limits, shutdown grace."""

from __future__ import annotations

from dataclasses import dataclass

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
    `max_prompt_chars` bounds the text tokenized for one request (a prompt, a chat's
    contents, a /tokenize input), `max_chat_messages` a chat's messages, `max_logit_bias`
    the entries of a logit_bias, `max_tools` a chat's tools, `max_logprobs` the top
    logprobs per token and `max_n` the samples of one request; every list is counted
    before any of its elements is looked at (`RequestLimits`).
    `grpc_stream_idle_timeout_s`: a gRPC response the client has not taken after this long
    (it stopped reading) ends its stream and aborts the request, so a stalled client holds no
    concurrency slot (None: it may wait forever). `metrics_auth`: /metrics needs a tenant's
    key, as generation does.
    `tokenizer_threads` tokenize and render chat templates off the event loop.
    `log_prompts` puts prompt text in the access log (off: it may be private).
    Built from the config file's `gateway` section, which checks the values
    (`bucketserve.deploy.serve_settings.GatewaySettings`).
    """

    host: str = "127.0.0.1"
    grpc_port: int = DEFAULT_GRPC_PORT
    http_port: int | None = DEFAULT_HTTP_PORT
    served_model_name: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    max_message_bytes: int = 1024 * 1024
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    drain_timeout_s: float = 30.0
    http_request_timeout_s: float | None = 600.0
    max_stop_strings: int = 64
    max_stop_chars: int = 4096
    max_stop_token_ids: int = 256
    max_prompt_chars: int = 1_000_000
    max_chat_messages: int = 4096
    max_logit_bias: int = 1024
    max_tools: int = 128
    max_logprobs: int = 20
    max_n: int = 16
    grpc_stream_idle_timeout_s: float | None = 60.0
    metrics_auth: bool = False
    tokenizer_threads: int = 2
    log_prompts: bool = False
    tool_call_parser: str | None = None  # model.tool_call_parser: reads calls for tool_choice auto

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None
