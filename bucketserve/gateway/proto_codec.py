"""Between `bucketserve.v1` messages and the gateway's types, both directions.

The server reads a GenerateRequest into a GenerateInput and writes StreamDeltas
as GenerateResponses; the SDK does the reverse, so the two never disagree.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from bucketserve.gateway.errors import InvalidArgumentError
from bucketserve.gateway.generate_input import GenerateInput
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.sdk_types import Chunk, ToolCall
from bucketserve.messages import RequestTimings, StreamDelta
from bucketserve.runtime.core.logprobs import TokenLogprob

if TYPE_CHECKING:
    from bucketserve.gateway.tools.tool_stream import ToolStream

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
    "error": pb.FINISH_REASON_ERROR,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}
TOOL_CHOICE_MODES = {
    "auto": pb.TOOL_CHOICE_MODE_AUTO,
    "none": pb.TOOL_CHOICE_MODE_NONE,
    "required": pb.TOOL_CHOICE_MODE_REQUIRED,
}
_MODE_NAMES = {v: k for k, v in TOOL_CHOICE_MODES.items()}
_REASON_NAMES = {v: k for k, v in FINISH_REASONS.items()}
_OPTIONAL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logprobs",
    "n",
    "prompt_logprobs",
    "skip_special_tokens",
)
_PROMPT_KINDS = ("text", "token_ids", "chat")
# StructuredOutputs' oneof <-> StructuredOutputsParams' fields
_STRUCTURED = {"json_schema": "json", "regex": "regex", "choice": "choice",
               "grammar": "grammar", "json_object": "json_object"}


def unknown_fields(message: Message, path: str = "") -> list[str]:
    """Field numbers the server's schema does not know, anywhere in `message` (binary
    clients built from a newer or different .proto send them; protobuf keeps them quietly)."""
    path = path or message.DESCRIPTOR.name
    found = [f"{path} #{f.field_number}" for f in UnknownFieldSet(message)]
    for desc, value in message.ListFields():
        if desc.message_type is None or desc.message_type.GetOptions().map_entry:
            continue
        children = value if desc.is_repeated else [value]
        for i, child in enumerate(children):
            index = f"[{i}]" if desc.is_repeated else ""
            found += unknown_fields(child, f"{path}.{desc.name}{index}")
    return found


# -- server side ---------------------------------------------------------------------------


def request_to_input(request: pb.GenerateRequest) -> GenerateInput:
    inp = GenerateInput(
        request_id=request.request_id or None,
        priority=request.priority,
        slo_ttft_s=request.ttft_slo_s if request.HasField("ttft_slo_s") else None,
        slo_tpot_s=request.tpot_slo_s if request.HasField("tpot_slo_s") else None,
        cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
        sampling=_sampling_from(request.sampling_params),
    )
    if request.sampling_params.HasField("structured_outputs"):
        kind = request.sampling_params.structured_outputs.WhichOneof("kind")
        inp.structured_name = "sampling_params.structured_outputs" + (f".{kind}" if kind else "")
    kind = request.WhichOneof("prompt")
    if kind == "text":
        inp.prompt = request.text
    elif kind == "token_ids":
        inp.prompt_token_ids = list(request.token_ids.ids)
    elif kind == "chat":
        inp.messages = [_message_from(m) for m in request.chat.messages]
    _tools_from(request, inp)
    return inp


def _message_from(m: pb.ChatMessage) -> dict[str, Any]:
    """A chat message as OpenAI's body has it, which chat templates take."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if len(m.tool_calls):
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


def _tools_from(request: pb.GenerateRequest, inp: GenerateInput) -> None:
    """The tools in OpenAI's form, each schema parsed (INVALID_ARGUMENT naming the tool)."""
    tools = []
    for i, tool in enumerate(request.tools):
        if not tool.name:
            raise InvalidArgumentError(f"tools[{i}].name is empty; name the function")
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            try:
                schema = json.loads(tool.parameters)
            except ValueError as exc:
                raise InvalidArgumentError(
                    f"tools[{i}].parameters ({tool.name}) is not JSON: {exc}; send its "
                    "arguments' JSON schema as JSON text"
                ) from None
            if not isinstance(schema, dict):
                raise InvalidArgumentError(
                    f"tools[{i}].parameters ({tool.name}) must be a JSON schema object, got "
                    f"{type(schema).__name__}"
                )
            function["parameters"] = schema
        tools.append({"type": "function", "function": function})
    inp.tools = tools or None
    if request.HasField("tool_choice"):
        choice = request.tool_choice
        kind = choice.WhichOneof("choice")
        if kind == "function":
            inp.tool_function = choice.function
        elif kind == "mode":
            if choice.mode not in _MODE_NAMES:
                raise InvalidArgumentError(
                    f"tool_choice.mode {choice.mode} is not a ToolChoiceMode this server knows"
                )
            inp.tool_choice = _MODE_NAMES[choice.mode]
    if request.HasField("parallel_tool_calls"):
        inp.parallel_tool_calls = request.parallel_tool_calls


def _sampling_from(params: pb.SamplingParams) -> dict[str, Any]:
    sampling: dict[str, Any] = {n: getattr(params, n) for n in _OPTIONAL_SAMPLING}
    sampling = {n: v for n, v in sampling.items() if params.HasField(n)}
    sampling.update(
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.logit_bias:
        sampling["logit_bias"] = dict(params.logit_bias)
    if params.HasField("structured_outputs"):
        sampling["structured_outputs"] = _structured_from(params.structured_outputs)
    return sampling


def _structured_from(so: pb.StructuredOutputs) -> dict[str, Any]:
    kind = so.WhichOneof("kind")
    if kind is None:
        return {}  # admission names the missing kind
    value: Any = getattr(so, kind)
    if kind == "choice":
        value = list(value.choices)
    out = {_STRUCTURED[kind]: value, "disable_any_whitespace": so.disable_any_whitespace}
    if so.HasField("whitespace_pattern"):
        out["whitespace_pattern"] = so.whitespace_pattern
    return out


def delta_to_response(delta: StreamDelta, cancel_reason: str | None = None) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=delta.request_id, token_ids=delta.token_ids, text=delta.text, index=delta.index
    )
    if delta.logprobs is not None:
        _write_logprobs(response.logprobs, delta.logprobs)
    if delta.prompt_logprobs is not None:
        _write_logprobs(response.prompt_logprobs, delta.prompt_logprobs)
    if delta.finish_reason is not None:
        response.finish_reason = FINISH_REASONS.get(delta.finish_reason, 0)
    if delta.finished:
        final = response.final
        final.finish_reason = FINISH_REASONS.get(delta.finish_reason or "error", 0)
        cancelled = delta.finish_reason == "cancelled"
        final.error = delta.error or (cancel_reason if cancelled else None) or ""
        final.usage.prompt_tokens = delta.num_prompt_tokens
        final.usage.completion_tokens = delta.num_output_tokens
        final.usage.cached_tokens = delta.num_cached_tokens
        if delta.timings is not None:
            final.timings.CopyFrom(pb.Timings(**dataclasses.asdict(delta.timings)))
        if delta.request_bucket is not None:
            low, up = delta.request_bucket
            final.request_bucket.CopyFrom(pb.RequestBucket(low=low, up=up))
        if delta.shape_bucket is not None:
            batch, query, blocks = delta.shape_bucket
            final.shape_bucket.CopyFrom(pb.ShapeBucket(batch=batch, query=query, blocks=blocks))
    return response


def write_tool_calls(response: pb.GenerateResponse, delta: StreamDelta, stream: ToolStream) -> None:
    """The delta's text as its sample's tool stream reads it: content in `text`, pieces of
    calls in `tool_calls`; a sample that called tools and stopped ends with TOOL_CALLS."""
    text, calls = stream.feed(delta.text)
    if delta.finish_reason is not None and delta.finish_reason != "error":
        rest, more = stream.finish()
        text, calls = text + rest, calls + more
    response.text = text
    response.tool_calls.extend(_tool_call(c) for c in calls)
    if stream.called and delta.finish_reason == "stop":
        response.finish_reason = pb.FINISH_REASON_TOOL_CALLS
        if response.HasField("final"):
            response.final.finish_reason = pb.FINISH_REASON_TOOL_CALLS


def merge_tool_calls(whole: Any, pieces: Iterable[pb.ToolCall]) -> None:
    """Pieces added to the whole calls of a repeated ToolCall field."""
    for piece in pieces:
        call = next((c for c in whole if c.index == piece.index), None)
        if call is None:
            whole.add().CopyFrom(piece)
        else:
            call.arguments += piece.arguments


def _tool_call(call: ToolCall) -> pb.ToolCall:
    return pb.ToolCall(index=call.index, id=call.id, name=call.name, arguments=call.arguments)


def _write_logprobs(field: Any, logprobs: list[TokenLogprob | None]) -> None:
    for lp in logprobs:
        out = field.add()
        if lp is not None:
            out.logprob = lp.logprob
            out.top.extend(pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top)


# -- client side ---------------------------------------------------------------------------


def input_to_request(inp: GenerateInput, stream: bool) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=inp.request_id or "", priority=inp.priority, stream=stream
    )
    if inp.slo_ttft_s is not None:
        request.ttft_slo_s = inp.slo_ttft_s
    if inp.slo_tpot_s is not None:
        request.tpot_slo_s = inp.slo_tpot_s
    if inp.cache_salt is not None:
        request.cache_salt = inp.cache_salt
    if inp.prompt is not None:
        request.text = inp.prompt
    elif inp.prompt_token_ids is not None:
        request.token_ids.ids.extend(inp.prompt_token_ids)
    elif inp.messages is not None:
        for m in inp.messages:
            _write_message(request.chat.messages.add(), m)
    _write_tools(request, inp)
    params = request.sampling_params
    for name, value in inp.sampling.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids"):
            getattr(params, name).extend(value)
        elif name == "logit_bias":
            params.logit_bias.update({int(k): float(v) for k, v in value.items()})
        elif name == "structured_outputs":
            _write_structured(params.structured_outputs, value)
        else:
            setattr(params, name, value)
    return request


def _write_message(out: pb.ChatMessage, m: dict[str, Any]) -> None:
    """`m`: role and content, and an assistant's calls (ToolCalls or OpenAI's dicts) or the
    call a tool message answers."""
    out.role, out.content = m["role"], m.get("content") or ""
    for c in m.get("tool_calls") or ():
        if isinstance(c, ToolCall):
            out.tool_calls.add(id=c.id, name=c.name, arguments=c.arguments)
        else:
            function = c["function"]
            arguments = function.get("arguments", "{}")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            out.tool_calls.add(id=c.get("id") or "", name=function["name"], arguments=arguments)
    out.tool_call_id = m.get("tool_call_id") or ""


def _write_tools(request: pb.GenerateRequest, inp: GenerateInput) -> None:
    for tool in inp.tools or ():
        function = tool["function"]
        params = function.get("parameters")
        if params is not None and not isinstance(params, str):
            params = json.dumps(params)
        request.tools.add(
            name=function["name"],
            description=function.get("description") or "",
            parameters=params or "",
        )
    if inp.tool_function is not None:
        request.tool_choice.function = inp.tool_function
    elif inp.tool_choice is not None:
        request.tool_choice.mode = TOOL_CHOICE_MODES[inp.tool_choice]
    if inp.parallel_tool_calls is not None:
        request.parallel_tool_calls = inp.parallel_tool_calls


def _write_structured(out: pb.StructuredOutputs, spec: Any) -> None:
    """`spec`: a StructuredOutputsParams or its fields as a dict."""
    fields = spec if isinstance(spec, dict) else dataclasses.asdict(spec)
    out.disable_any_whitespace = bool(fields.get("disable_any_whitespace"))
    if fields.get("whitespace_pattern") is not None:
        out.whitespace_pattern = fields["whitespace_pattern"]
    for kind, name in _STRUCTURED.items():
        value = fields.get(name)
        if value is None or value is False:
            continue
        if kind == "json_schema":
            out.json_schema = value if isinstance(value, str) else json.dumps(value)
        elif kind == "choice":
            out.choice.choices.extend(value)
        else:
            setattr(out, kind, value)


def response_to_chunk(response: pb.GenerateResponse) -> Chunk:
    chunk = Chunk(
        response.request_id, list(response.token_ids), response.text, index=response.index
    )
    if len(response.logprobs):
        chunk.logprobs = _read_logprobs(response.logprobs)
    if len(response.prompt_logprobs):
        chunk.prompt_logprobs = _read_logprobs(response.prompt_logprobs)
    if response.finish_reason:
        chunk.finish_reason = _REASON_NAMES.get(response.finish_reason, "error")
    chunk.tool_calls = [
        ToolCall(c.index, c.id, c.name, c.arguments) for c in response.tool_calls
    ]
    if response.HasField("final"):
        final = response.final
        chunk.finished = True
        chunk.finish_reason = _REASON_NAMES.get(final.finish_reason, "error")
        chunk.error = final.error or None
        chunk.prompt_tokens = final.usage.prompt_tokens
        chunk.completion_tokens = final.usage.completion_tokens
        chunk.cached_tokens = final.usage.cached_tokens
        if final.HasField("timings"):
            t = final.timings
            chunk.timings = RequestTimings(
                t.queue_s, t.prefill_s, t.transfer_s, t.first_token_s, t.decode_s
            )
        if final.HasField("request_bucket"):
            chunk.request_bucket = (final.request_bucket.low, final.request_bucket.up)
        if final.HasField("shape_bucket"):
            s = final.shape_bucket
            chunk.shape_bucket = (s.batch, s.query, s.blocks)
    return chunk


def _read_logprobs(field: Any) -> list[TokenLogprob | None]:
    return [
        TokenLogprob(lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
        if lp.HasField("logprob")
        else None
        for lp in field
    ]
