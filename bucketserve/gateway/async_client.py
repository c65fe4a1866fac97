"""The asyncio Python client of the gRPC API.

    async with AsyncClient("localhost:50051") as client:
        async for chunk in client.stream("Hello", SamplingParams(max_tokens=32)):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
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


class AsyncClient(ClientBase):
    """Like Client, with coroutines and async iterators. Leaving a stream early cancels the
    request once the iterator is closed: wrap it in `contextlib.aclosing` to do so at once."""

    def __init__(self, target: str = DEFAULT_TARGET, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        if self.credentials is not None:
            self.channel = grpc.aio.secure_channel(self.target, self.credentials, self.options)
        else:
            self.channel = grpc.aio.insecure_channel(self.target, self.options)
        self.stub = pb_grpc.GenerationStub(self.channel)

    async def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None, **kw: Any
    ) -> Completion:
        inp = build_input(prompt, None, sampling_params, **kw)
        return whole([chunk async for chunk in self._call(inp, kw, False)])

    def stream(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None, **kw: Any
    ) -> AsyncIterator[Chunk]:
        return self._call(build_input(prompt, None, sampling_params, **kw), kw, True)

    async def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Tool | dict[str, Any]] | None = None,
        tool_choice: ToolChoice | str | None = None,
        parallel_tool_calls: bool | None = None,
        **kw: Any,
    ) -> Completion:
        """Like Client.chat."""
        kw.update(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)
        inp = build_input(None, messages, sampling_params, **kw)
        return whole([chunk async for chunk in self._call(inp, kw, False)])

    def chat_stream(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Tool | dict[str, Any]] | None = None,
        tool_choice: ToolChoice | str | None = None,
        parallel_tool_calls: bool | None = None,
        **kw: Any,
    ) -> AsyncIterator[Chunk]:
        kw.update(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)
        return self._call(build_input(None, messages, sampling_params, **kw), kw, True)

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        request = pb.AbortRequest(request_id=request_id)
        return (await self._unary(self.stub.Abort, request, timeout)).aborted

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        info = await self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)
        return model_info_from(info)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        deadline, attempt = self._deadline(timeout), 0
        while True:
            try:
                return await method(
                    request, timeout=self._remaining(deadline), metadata=self.metadata
                )
            except grpc.RpcError as err:
                error = rpc_error(err)
                wait = self._retry_wait(error, attempt, deadline)
                if wait is None:
                    raise error from None
            await asyncio.sleep(wait)
            attempt += 1

    async def _call(
        self, inp: GenerateInput, kw: dict[str, Any], stream: bool
    ) -> AsyncIterator[Chunk]:
        request = input_to_request(inp, stream)
        deadline, attempt = self._deadline(kw.get("timeout")), 0
        while True:
            timeout = self._remaining(deadline)
            call = self.stub.Generate(request, timeout=timeout, metadata=self.metadata)
            received = False
            try:
                async for response in call:
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
            await asyncio.sleep(wait)
            attempt += 1
