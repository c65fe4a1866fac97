"""The `bucketserve.v1.Generation` service over the shared admission path."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from bucketserve.gateway.access_log import AccessLog
from bucketserve.gateway.admission import Admission
from bucketserve.gateway.errors import (
    BucketServeError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
)
from bucketserve.gateway.generate_input import GenerateInput
from bucketserve.gateway.generation import Generation
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2_grpc as pb_grpc
from bucketserve.gateway.proto_codec import (
    delta_to_response,
    merge_tool_calls,
    request_to_input,
    unknown_fields,
    write_tool_calls,
)
from bucketserve.gateway.request_limits import RequestLimits
from bucketserve.gateway.rich_status import status_trailers
from bucketserve.gateway.tenant_registry import parse_bearer
from bucketserve.gateway.tools.request_tools import RequestTools
from bucketserve.gateway.tools.tool_parsers import tool_parser
from bucketserve.gateway.tools.tool_stream import ToolStream

logger = logging.getLogger(__name__)
T = TypeVar("T")
STATUS_WAIT_S = 1.0  # how long an error status may wait to go out before the handler ends


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, admission: Admission, model_name: str, access_log: AccessLog) -> None:
        self.admission = admission
        self.model_name = model_name
        self.access_log = access_log
        self.tool_parser = tool_parser(admission.model.tool_call_parser)

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> None:
        started, gen = time.monotonic(), None
        try:
            gen, tools = await _guard(context, lambda: self._admit(request, context))
            try:
                await _guard(context, lambda: self._run(gen, request.stream, context, tools))
            finally:
                await gen.close()
        finally:
            code = grpc.StatusCode.CANCELLED if context.cancelled() else context.code()
            status = (code or grpc.StatusCode.OK).name
            tenant = gen.tenant.name if gen is not None else None
            self.access_log.record("grpc Generate", status, started, tenant, gen)

    async def _run(
        self, gen: Generation, stream: bool, context: Any, tools: RequestTools | None
    ) -> None:
        """The request's responses within the client's deadline; the request is closed
        before any error status goes out (a status waits behind the responses a stalled
        client has not taken)."""
        try:
            await asyncio.wait_for(
                self._stream(gen, stream, context, tools), context.time_remaining()
            )
        except TimeoutError:
            raise DeadlineExceededError(
                f"the deadline passed after {gen.num_output_tokens} tokens and the request "
                "was aborted; raise the client's timeout or lower max_tokens"
            ) from None
        finally:
            await gen.close()

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        async def abort() -> pb.AbortResponse:
            _check_known(request)
            if not request.request_id:
                raise InvalidArgumentError("request_id is empty; name the request to abort")
            tenant = self.admission.tenant(_api_key(context))
            return pb.AbortResponse(aborted=await self.admission.abort(request.request_id, tenant))

        return await _guard(context, abort)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Any) -> pb.ModelInfo:
        async def info() -> pb.ModelInfo:
            _check_known(request)
            tenant = self.admission.tenant(_api_key(context))
            return pb.ModelInfo(
                model=self.model_name,
                max_model_len=self.admission.max_model_len,
                block_size=self.admission.model.block_size,
                vocab_size=self.admission.vocab_size,
                tenant=tenant.name,
            )

        return await _guard(context, info)

    async def _admit(
        self, request: pb.GenerateRequest, context: Any
    ) -> tuple[Generation, RequestTools | None]:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceededError("the deadline passed before the request was admitted")
        api_key = _api_key(context)
        self.admission.tenant(api_key)  # who asks, before their request is looked at
        with self.admission.counted():
            _check_sizes(request, self.admission.limits)
            _check_known(request)
            inp = request_to_input(request)
            tools = self._tools(inp)
        return await self.admission.admit(inp, api_key), tools

    def _tools(self, inp: GenerateInput) -> RequestTools | None:
        """The request's tools; with tool_choice required or a function, their schema
        becomes the output's constraint, as over HTTP."""
        tools = RequestTools.of(inp)
        if tools is None:
            return None
        if inp.messages is None:
            raise InvalidArgumentError(
                "tools need a chat prompt (GenerateRequest.chat): its template renders them"
            )
        tools.check_parser(self.tool_parser)
        if tools.forced:
            if inp.sampling.get("structured_outputs") is not None:
                raise InvalidArgumentError(
                    "give at most one output constraint: sampling_params.structured_outputs "
                    "or tool_choice required / a function"
                )
            inp.sampling["structured_outputs"] = {"json": tools.schema()}
            inp.structured_name = "tools"
        return tools

    async def _write(self, gen: Generation, response: pb.GenerateResponse, context: Any) -> None:
        """One response, which the client must take within gateway.grpc_stream_idle_timeout_s
        (HTTP/2 flow control holds it back while the client reads nothing)."""
        idle_s = self.admission.config.grpc_stream_idle_timeout_s
        try:
            async with asyncio.timeout(idle_s):
                await context.write(response)
        except TimeoutError:
            raise DeadlineExceededError(
                f"the client read nothing for {idle_s:g}s (gateway.grpc_stream_idle_timeout_s) "
                f"and the request was aborted after {gen.num_output_tokens} tokens; read the "
                "stream as it comes"
            ) from None

    async def _stream(
        self, gen: Generation, stream: bool, context: Any, tools: RequestTools | None
    ) -> None:
        """Each delta as it comes, or (stream=false) one message per sample with its whole
        output, the request's final fields on the last. With tools each sample's text goes
        through its ToolStream: content in `text`, calls in `tool_calls`."""
        wholes = [
            pb.GenerateResponse(request_id=gen.request_id, index=i)
            for i in range(len(gen.choices))
        ]
        tool_streams: dict[int, ToolStream | None] = {}
        async for delta in gen:
            response = delta_to_response(delta, gen.cancel_reason)
            if tools is not None:
                if delta.index not in tool_streams:
                    tool_streams[delta.index] = tools.stream(self.tool_parser)
                tool_stream = tool_streams[delta.index]
                if tool_stream is not None:
                    write_tool_calls(response, delta, tool_stream)
            if stream:
                await self._write(gen, response, context)
                continue
            whole = wholes[delta.index]
            whole.token_ids.extend(response.token_ids)
            whole.text += response.text
            whole.logprobs.extend(response.logprobs)
            whole.prompt_logprobs.extend(response.prompt_logprobs)
            merge_tool_calls(whole.tool_calls, response.tool_calls)
            if response.finish_reason:
                whole.finish_reason = response.finish_reason
            if response.HasField("final"):
                last = wholes.pop(delta.index)
                for other in wholes:
                    await self._write(gen, other, context)
                last.final.CopyFrom(response.final)
                await self._write(gen, last, context)


def _api_key(context: Any) -> str | None:
    metadata = dict(context.invocation_metadata() or ())
    return parse_bearer(metadata.get("authorization"))


def _check_sizes(request: pb.GenerateRequest, limits: RequestLimits) -> None:
    """Every list the request carries, counted before any element is read."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        limits.prompt_tokens(len(request.token_ids.ids))
    elif kind == "text":
        limits.prompt_chars("prompt", len(request.text))
    elif kind == "chat":
        limits.chat_messages(len(request.chat.messages))
    params = request.sampling_params
    limits.stop_token_ids(len(params.stop_token_ids))
    limits.stop_count(len(params.stop))
    limits.tools(len(request.tools))


def _check_known(request: Any) -> None:
    """Fields from a newer .proto are ignored, as proto3 does (logged for the operator)."""
    if logger.isEnabledFor(logging.DEBUG):
        unknown = unknown_fields(request)
        if unknown:
            logger.debug("ignoring unknown fields %s of a newer client", unknown)


async def _guard(context: Any, call: Callable[[], Awaitable[T]]) -> T:
    """`await call()`, ending the RPC with the matching status if it raises."""
    try:
        return await call()
    except BucketServeError as exc:
        error = exc
    except Exception:
        logger.exception("bug while handling an RPC")
        error = InternalError("the server hit a bug; see its log")
    await _fail(context, error)


async def _fail(context: Any, error: BucketServeError) -> NoReturn:
    try:
        async with asyncio.timeout(STATUS_WAIT_S):
            await context.abort(
                error.code, error.message, trailing_metadata=status_trailers(error)
            )
    except TimeoutError:
        # queued behind responses a stalled client has not read: it gets the status when it
        # reads on, and this handler need not wait for that
        raise asyncio.CancelledError from None
