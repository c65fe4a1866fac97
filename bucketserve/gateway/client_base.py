"""What the sync and asyncio clients share: settings, request building, error mapping."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from bucketserve import envs
from bucketserve.gateway.errors import BucketServeError, GenerationError, error_for_status
from bucketserve.gateway.gateway_config import DEFAULT_GRPC_PORT
from bucketserve.gateway.generate_input import GenerateInput
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.retry_policy import RetryPolicy
from bucketserve.gateway.rich_status import retry_delay
from bucketserve.gateway.sdk_types import Chunk, Completion, ModelInfo, Tool, ToolChoice
from bucketserve.runtime.core.sampling_params import SamplingParams

API_KEY_ENV = "BUCKETSERVE_API_KEY"
DEFAULT_TARGET = f"localhost:{DEFAULT_GRPC_PORT}"
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
]


class ClientBase:
    """`api_key` defaults to $BUCKETSERVE_API_KEY; `timeout` (seconds) is the default
    deadline of each call, retries included; `root_certificates` (PEM) or `secure=True`
    switch on TLS."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        secure: bool = False,
        root_certificates: bytes | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        key = api_key if api_key is not None else envs.BUCKETSERVE_API_KEY
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()
        self.credentials = (
            grpc.ssl_channel_credentials(root_certificates)
            if secure or root_certificates
            else None
        )
        self.options = [*CHANNEL_OPTIONS, *options]

    def _deadline(self, timeout: float | None) -> float | None:
        """When the whole call, every retry included, must be done (monotonic clock)."""
        timeout = self.timeout if timeout is None else timeout
        return None if timeout is None else time.monotonic() + timeout

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _retry_wait(
        self, error: BucketServeError, attempt: int, deadline: float | None
    ) -> float | None:
        """Seconds to wait before trying again; None: give up, because the policy says so or
        the call's deadline would pass before the next attempt could start."""
        if not self.retry.should_retry(error, attempt):
            return None
        wait = self.retry.backoff(attempt)
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None
        return wait


def build_input(
    prompt: str | list[int] | None = None,
    messages: list[dict[str, str]] | None = None,
    sampling_params: SamplingParams | None = None,
    *,
    request_id: str | None = None,
    priority: int = 0,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
    cache_salt: str | None = None,
    timeout: float | None = None,
    tools: Sequence[Tool | dict[str, Any]] | None = None,
    tool_choice: ToolChoice | str | None = None,
    parallel_tool_calls: bool | None = None,
) -> GenerateInput:
    """The request the SDK sends; SamplingParams checks its values before anything is sent.
    (`timeout` belongs to the call, not the request.) `tools`: Tools or OpenAI's
    {"type": "function", "function": {...}}; `tool_choice`: a ToolChoice or its mode.
    `cache_salt`: only requests with the same salt share cached prompt blocks."""
    params = SamplingParams() if sampling_params is None else sampling_params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    inp = GenerateInput(
        messages=messages,
        sampling=dataclasses.asdict(params),
        request_id=request_id,
        priority=priority,
        slo_ttft_s=ttft_slo_s,
        slo_tpot_s=tpot_slo_s,
        cache_salt=cache_salt,
    )
    _set_tools(inp, tools, tool_choice, parallel_tool_calls)
    if isinstance(prompt, str):
        inp.prompt = prompt
    elif isinstance(prompt, (list, tuple)):
        inp.prompt_token_ids = list(prompt)
    elif prompt is not None:
        raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt)}")
    return inp


def _set_tools(
    inp: GenerateInput,
    tools: Sequence[Tool | dict[str, Any]] | None,
    tool_choice: ToolChoice | str | None,
    parallel_tool_calls: bool | None,
) -> None:
    if tools:
        inp.tools = [t.as_dict() if isinstance(t, Tool) else t for t in tools]
    if isinstance(tool_choice, str):
        tool_choice = ToolChoice(mode=tool_choice)  # type: ignore[arg-type]
    if tool_choice is not None:
        if not isinstance(tool_choice, ToolChoice):
            raise TypeError(f"tool_choice must be a ToolChoice or a mode, got {tool_choice!r}")
        if tool_choice.function is not None:
            inp.tool_function = tool_choice.function
        elif tool_choice.mode not in ("none", "auto", "required"):
            raise ValueError(
                f"tool_choice must be 'none', 'auto', 'required' or ToolChoice.named(function), "
                f"got {tool_choice.mode!r}"
            )
        else:
            inp.tool_choice = tool_choice.mode
    inp.parallel_tool_calls = parallel_tool_calls


def rpc_error(err: grpc.RpcError) -> BucketServeError:
    """The SDK's exception for a failed call (sync or asyncio)."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    trailing = err.trailing_metadata() if callable(getattr(err, "trailing_metadata", None)) else ()
    return error_for_status(code, details or code.name, retry_delay(trailing))


def whole(chunks: Iterable[Chunk]) -> Completion:
    """The whole output; GenerationError if the request ended in an error."""
    completion = Completion.from_chunks(chunks)
    if completion.finish_reason == "error" or any(
        s.finish_reason == "error" for s in completion.choices
    ):
        raise GenerationError(f"generation failed: {completion.error}")
    return completion


def model_info_from(info: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(info.model, info.max_model_len, info.block_size, info.vocab_size, info.tenant)
