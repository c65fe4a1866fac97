"""Tools over gRPC at the edge: the SDK's typed tools and tool_choice reach the server as
the .proto's fields and back, and a request the tools cannot serve is INVALID_ARGUMENT
naming the field before anything is generated (the tiny model's open server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bucketserve import Client, InvalidArgumentError, SamplingParams, Tool, ToolCall, ToolChoice
from bucketserve.gateway.client_base import build_input
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.proto_codec import (
    input_to_request,
    merge_tool_calls,
    request_to_input,
    response_to_chunk,
)
from bucketserve.gateway.sdk_types import Completion

ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}}
ASK = [{"role": "user", "content": "What time is it?"}]


def test_tools_and_calls_cross_the_proto_both_ways() -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        ToolCall(0, "call_1", "get_time", '{"zone": "UTC"}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    inp = build_input(None, history, None, tools=[Tool("get_time", ZONE, "The time."),
                      Tool("ping")], tool_choice=ToolChoice.named("get_time"),
                      parallel_tool_calls=False)
    request = input_to_request(inp, stream=True)
    assert json.loads(request.tools[0].parameters) == ZONE and request.tools[1].parameters == ""
    assert request.tool_choice.function == "get_time" and not request.parallel_tool_calls
    back = request_to_input(pb.GenerateRequest.FromString(request.SerializeToString()))
    assert back.tools == [
        {"type": "function", "function": {"name": "get_time", "description": "The time.",
                                          "parameters": ZONE}},
        {"type": "function", "function": {"name": "ping"}},
    ]
    assert (back.tool_function, back.tool_choice, back.parallel_tool_calls) == (
        "get_time", None, False)
    assert back.messages[1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_time", "arguments": '{"zone": "UTC"}'}}]
    assert back.messages[2]["tool_call_id"] == "call_1"
    required = request_to_input(input_to_request(
        build_input(None, ASK, None, tools=[Tool("ping")], tool_choice="required"), False))
    assert required.tool_choice == "required" and required.parallel_tool_calls is None
    with pytest.raises(ValueError, match="tool_choice must be"):
        build_input(None, ASK, None, tools=[Tool("ping")], tool_choice="always")


def test_streamed_call_pieces_make_whole_calls() -> None:
    pieces = [pb.ToolCall(index=0, id="call_a", name="f", arguments='{"a"'),
              pb.ToolCall(index=1, id="call_b", name="g", arguments="{}"),
              pb.ToolCall(index=0, arguments=": 1}")]
    whole = pb.GenerateResponse()
    merge_tool_calls(whole.tool_calls, pieces)
    assert [(c.index, c.id, c.name, c.arguments) for c in whole.tool_calls] == [
        (0, "call_a", "f", '{"a": 1}'), (1, "call_b", "g", "{}")]
    chunks = [response_to_chunk(pb.GenerateResponse(request_id="r", tool_calls=[p]))
              for p in pieces]
    last = pb.GenerateResponse(request_id="r", finish_reason=pb.FINISH_REASON_TOOL_CALLS)
    last.final.finish_reason = pb.FINISH_REASON_TOOL_CALLS
    completion = Completion.from_chunks([*chunks, response_to_chunk(last)])
    assert completion.finish_reason == "tool_calls"
    assert [(c.name, c.parsed()) for c in completion.tool_calls] == [("f", {"a": 1}), ("g", {})]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tools": [Tool("f", "{not json")]}, r"tools\[0\]\.parameters \(f\) is not JSON"),
        ({"tools": [Tool("f", "[1]")]}, r"tools\[0\]\.parameters \(f\) must be a JSON schema"),
        ({"tools": [Tool("")]}, r"tools\[0\]\.name is empty"),
        ({"tools": [Tool("f")], "tool_choice": ToolChoice.named("g")},
         r"'g' is not among tools \(\['f'\]\)"),
        ({"tools": [Tool(f"f{i}") for i in range(129)], "tool_choice": "none"},
         r"tools has 129 entries; this server takes at most 128 \(gateway\.max_tools\)"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [Tool("f")]}, r"needs a tool call parser.*model\.tool_call_parser"),
        ({"tools": [Tool("f")], "tool_choice": "required",
          "sampling_params": SamplingParams(structured_outputs={"regex": "a"})},
         "at most one output constraint"),
    ],
)
def test_bad_tools_are_invalid_argument_naming_the_field(
    open_server: Any, kwargs: dict[str, Any], match: str
) -> None:
    params = kwargs.pop("sampling_params", SamplingParams(max_tokens=2))
    with Client(open_server.grpc_target) as sdk, pytest.raises(InvalidArgumentError, match=match):
        sdk.chat(ASK, params, **kwargs)


def test_tools_need_a_chat_prompt(open_server: Any) -> None:
    with Client(open_server.grpc_target) as sdk:
        with pytest.raises(InvalidArgumentError, match="tools need a chat prompt"):
            sdk.generate("Hi", SamplingParams(max_tokens=2), tools=[Tool("f")],
                         tool_choice="required")
        out = sdk.chat(ASK, SamplingParams(max_tokens=2), tools=[Tool("f")], tool_choice="none")
        assert out.tool_calls == [] and len(out.token_ids) == 2
