"""The blocking Python client of the gRPC API.

    from bucketserve import Client, SamplingParams

    with Client("localhost:50051") as client:
        for chunk in client.stream("Hello", SamplingParams(max_tokens=32)):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from bucketserve.gateway.client_base import (
    DEFAULT_TARGET,
    ClientBase,
    build_input,
    model_info_from,
    rpc_error,
    whole,
)
from bucketserve.gateway.generate_input import GenerateInput
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2_grpc as pb_grpc
from bucketserve.gateway.proto_codec import input_to_request, response_to_chunk
from bucketserve.gateway.sdk_types import Chunk, Completion, ModelInfo, Tool, ToolChoice
from bucketserve.runtime.core.sampling_params import SamplingParams


class Client(ClientBase):
    """Calls raise the BucketServeError subclass of the status they got (InvalidArgumentError,
    AuthenticationError, ResourceExhaustedError with retry_after_s, ...). Keyword options of
    generate / stream / chat: request_id, priority, ttft_slo_s, tpot_slo_s, cache_salt, timeout."""

    def __init__(self, target: str = DEFAULT_TARGET, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        if self.credentials is not None:
            self.channel = grpc.secure_channel(self.target, self.credentials, self.options)
        else:
            self.channel = grpc.insecure_channel(self.target, self.options)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None, **kw: Any
    ) -> Completion:
        """The whole output; raises GenerationError if the request ended in an error."""
        return whole(self._call(build_input(prompt, None, sampling_params, **kw), kw, False))

    def stream(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None, **kw: Any
    ) -> Iterator[Chunk]:
        """Chunks as tokens come; the last has `finished=True`. Leaving the loop early
        cancels the request and frees its KV blocks on the server."""
        return self._call(build_input(prompt, None, sampling_params, **kw), kw, True)

    def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Tool | dict[str, Any]] | None = None,
        tool_choice: ToolChoice | str | None = None,
        parallel_tool_calls: bool | None = None,
        **kw: Any,
    ) -> Completion:
        """`tools` the model may call and `tool_choice` ("none", "auto", "required" or
        ToolChoice.named(function)); its calls come in `tool_calls`, and `text` is the
        content outside them. Messages may carry an assistant's `tool_calls` and a tool's
        `tool_call_id`."""
        kw.update(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)
        return whole(self._call(build_input(None, messages, sampling_params, **kw), kw, False))

    def chat_stream(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Tool | dict[str, Any]] | None = None,
        tool_choice: ToolChoice | str | None = None,
        parallel_tool_calls: bool | None = None,
        **kw: Any,
    ) -> Iterator[Chunk]:
        """Chunks as tokens come; with tools, each chunk's `tool_calls` holds pieces of the
        calls as the model writes them (arguments streamed)."""
        kw.update(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)
        return self._call(build_input(None, messages, sampling_params, **kw), kw, True)

    def abort(self, request_id: str, timeout: float | None = None) -> bool:
        """Cancel a running request of this tenant; False if it already finished."""
        request = pb.AbortRequest(request_id=request_id)
        return self._unary(self.stub.Abort, request, timeout).aborted

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        info = self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)
        return model_info_from(info)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        deadline, attempt = self._deadline(timeout), 0
        while True:
            try:
                return method(
                    request, timeout=self._remaining(deadline), metadata=self.metadata
                )
            except grpc.RpcError as err:
                error = rpc_error(err)
                wait = self._retry_wait(error, attempt, deadline)
                if wait is None:
                    raise error from None
            time.sleep(wait)
            attempt += 1

    def _call(self, inp: GenerateInput, kw: dict[str, Any], stream: bool) -> Iterator[Chunk]:
        request = input_to_request(inp, stream)
        deadline, attempt = self._deadline(kw.get("timeout")), 0
        while True:
            timeout = self._remaining(deadline)
            call = self.stub.Generate(request, timeout=timeout, metadata=self.metadata)
            received = False
            try:
                for response in call:
                    received = True
                    yield response_to_chunk(response)
                return
            except grpc.RpcError as err:
                error = rpc_error(err)
                wait = None if received else self._retry_wait(error, attempt, deadline)
                if wait is None:
                    raise error from None
            finally:
                call.cancel()
            time.sleep(wait)
            attempt += 1
