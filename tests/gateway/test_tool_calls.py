"""Tools over OpenAI HTTP and the gRPC SDK: `required` and a named function constrain the
output to the tools' schemas, `auto` reads calls out of the text with the configured parser
(a hermes-style template renders the tools), streamed arguments come in pieces as they are
written and add up to the non-streamed calls, and tool history renders. The readers are
also checked on hand-split text: every split gives the same calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from bucketserve import Client, InvalidArgumentError, SamplingParams, Tool, ToolChoice
from bucketserve.gateway.sdk_types import merge_tool_calls
from bucketserve.gateway.tools.call_reader import ArrayCallReader, CallReader, NamedCallReader
from bucketserve.gateway.tools.json_scan import ObjectScanner
from bucketserve.gateway.tools.request_tools import RequestTools
from bucketserve.gateway.tools.tool_parsers import HermesToolParser, Llama3JsonToolParser
from bucketserve.gateway.tools.tool_stream import ToolStream
from tests.gateway.conftest import http_post, start_server
from tests.gateway.test_structured_output import oai, serve

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "London"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# ChatML with the tools in a system turn and calls as <tool_call> JSON (the hermes way)
HERMES = (
    "{% if tools %}<|im_start|>system\nYou may call these functions, each as "
    '<tool_call>{"name": ..., "arguments": ...}</tool_call>:\n'
    "{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}'
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL_REGEX = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
    r'"unit": "celsius"\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def hermes(loop_thread: Any, smollm_dir: Path) -> Iterator[Any]:
    yield from serve(
        loop_thread, smollm_dir, "disaggregated", chat_template=HERMES, tool_call_parser="hermes"
    )


def calls_of(message: Any) -> list[tuple[str, str]]:
    """(name, arguments JSON text) of each call, the text parsed to check it is JSON."""
    for c in message.tool_calls:
        json.loads(c.function.arguments)
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


def streamed(
    client: openai.OpenAI, **body: Any
) -> tuple[str, list[tuple[str, str]], str, list[int]]:
    """(content, calls, finish_reason, arguments pieces per call) assembled from a stream's
    deltas; each call's first delta has its id, type and name, and no later one has them."""
    content, finish = "", ""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.get(d.index)
                if call is None:
                    assert d.id and d.id.startswith("call_") and d.type == "function"
                    assert d.function.name
                    call = calls[d.index] = {"name": d.function.name, "pieces": []}
                else:
                    assert d.id is None and d.function.name is None, d
                call["pieces"].append(d.function.arguments or "")
            finish = choice.finish_reason or finish
    got = [(c["name"], "".join(c["pieces"])) for _, c in sorted(calls.items())]
    pieces = [sum(1 for p in c["pieces"] if p) for _, c in sorted(calls.items())]
    return content, got, finish, pieces


@pytest.mark.smollm
@pytest.mark.slow
def test_required_and_named_tool_choice_return_calls_that_validate(hermes: Any) -> None:
    server, _ = hermes
    client = oai(server)
    body: dict[str, Any] = {
        "model": server.model_name,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 48,
        "temperature": 0,
    }
    out = client.chat.completions.create(**body)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = calls_of(choice.message)
    assert len(calls) == 1 and calls[0][0] in SCHEMAS
    jsonschema.validate(json.loads(calls[0][1]), SCHEMAS[calls[0][0]])
    assert choice.message.tool_calls[0].id.startswith("call_")
    content, stream_calls, finish, pieces = streamed(client, **body)
    assert (content, stream_calls, finish) == ("", calls, "tool_calls")
    assert pieces[0] > 1  # the arguments went out as they were written

    named = {**body, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    out = client.chat.completions.create(**named)
    calls = calls_of(out.choices[0].message)
    assert [name for name, _ in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0][1]), TIME)
    content, stream_calls, finish, pieces = streamed(client, **named)
    assert (content, stream_calls, finish) == ("", calls, "tool_calls") and pieces[0] > 1


@pytest.mark.smollm
@pytest.mark.slow
def test_auto_parses_a_hermes_call_out_of_the_text(hermes: Any) -> None:
    server, _ = hermes
    client = oai(server)
    base = {"model": server.model_name, "messages": ASK, "max_tokens": 40, "temperature": 0}
    plain = client.chat.completions.create(**base, max_completion_tokens=1)
    with_tools = client.chat.completions.create(**base, tools=TOOLS, max_completion_tokens=1,
                                                tool_choice="none")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # tools rendered

    body = {**base, "tools": TOOLS, "extra_body": {"structured_outputs": {"regex": CALL_REGEX}}}
    out = client.chat.completions.create(**body)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = calls_of(choice.message)
    assert len(calls) == 1 and calls[0][0] == "get_weather"
    jsonschema.validate(json.loads(calls[0][1]), WEATHER)
    content, stream_calls, finish, pieces = streamed(client, **body)
    assert (content, stream_calls, finish) == ("", calls, "tool_calls") and pieces[0] > 1

    text = {**base, "tools": TOOLS, "extra_body": {"guided_regex": "It is sunny<tool_cal"}}
    out = client.chat.completions.create(**text)
    assert out.choices[0].message.content == "It is sunny<tool_cal"
    assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason == "stop"
    assert streamed(client, **text) == ("It is sunny<tool_cal", [], "stop", [])


@pytest.mark.smollm
@pytest.mark.slow
def test_tool_history_renders_and_auto_without_a_parser_is_a_400(
    hermes: Any, loop_thread: Any, backend: Any
) -> None:
    server, _ = hermes
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
    ]
    status, out, _ = http_post(
        f"{server.http_url}/v1/chat/completions",
        {"messages": history, "tools": TOOLS, "max_tokens": 2},
    )
    assert status == 200, out
    bare = start_server(loop_thread, backend)  # a model served without model.tool_call_parser
    try:
        status, out, _ = http_post(
            f"{bare.http_url}/v1/chat/completions", {"messages": ASK, "tools": TOOLS}
        )
        assert status == 400 and "model.tool_call_parser" in out["error"]["message"]
        status, out, _ = http_post(
            f"{bare.http_url}/v1/chat/completions",
            {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function",
             "function": {"name": "nope"}}},
        )
        assert status == 400 and "'nope' is not among tools" in out["error"]["message"]
    finally:
        loop_thread.run(bare.stop(0))


@pytest.mark.smollm
@pytest.mark.slow
def test_grpc_sdk_tools_required_and_named_and_streamed_pieces(hermes: Any) -> None:
    server, _ = hermes
    tools = [Tool("get_weather", WEATHER, "The weather."), Tool("get_time", json.dumps(TIME))]
    params = SamplingParams(max_tokens=48, temperature=0)
    with Client(server.grpc_target) as sdk:
        out = sdk.chat(ASK, params, tools=tools, tool_choice="required",
                       parallel_tool_calls=False)
        assert out.finish_reason == "tool_calls" and out.text == "", out
        [call] = out.tool_calls
        assert call.id.startswith("call_") and call.name in SCHEMAS
        jsonschema.validate(call.parsed(), SCHEMAS[call.name])

        chunks = list(sdk.chat_stream(ASK, params, tools=tools, tool_choice="required",
                                      parallel_tool_calls=False))
        pieces = [c for chunk in chunks for c in chunk.tool_calls]
        assert sum(1 for p in pieces if p.arguments) > 1 and {p.index for p in pieces} == {0}
        assert pieces[0].id and all(not p.id and not p.name for p in pieces[1:])
        assert merge_tool_calls(pieces)[0].arguments == call.arguments
        assert chunks[-1].finished and chunks[-1].finish_reason == "tool_calls"

        out = sdk.chat(ASK, params, tools=tools, tool_choice=ToolChoice.named("get_time"))
        assert [c.name for c in out.tool_calls] == ["get_time"]
        jsonschema.validate(out.tool_calls[0].parsed(), TIME)
        assert out.choices[0].tool_calls == out.tool_calls

        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": out.tool_calls},
                   {"role": "tool", "tool_call_id": out.tool_calls[0].id, "content": "12:00"}]
        assert sdk.chat(history, SamplingParams(max_tokens=2), tools=tools,
                        tool_choice="none").tool_calls == []
        with pytest.raises(InvalidArgumentError, match=r"tools\[1\] \(get_time\) parameters"):
            sdk.chat(ASK, params, tools=[tools[0], Tool("get_time", {"type": "foo"})],
                     tool_choice="required")


def split_runs(reader: type[CallReader] | Any, text: str, forced: bool = False) -> set[Any]:
    """What a ToolStream makes of `text` fed whole, a character at a time and cut at every
    point: (content, calls) for each way (one element if every split agrees)."""
    cuts = [[], list(range(1, len(text)))] + [[i] for i in range(1, len(text))]
    out = set()
    for points in cuts:
        stream = ToolStream(reader(), forced)
        content, pieces, at = "", [], 0
        for cut in [*points, len(text)]:
            got, deltas = stream.feed(text[at:cut])
            content, pieces, at = content + got, pieces + deltas, cut
        got, deltas = stream.finish()
        calls = merge_tool_calls(pieces + deltas)
        assert all(c.id for c in calls)
        out.add((content + got, tuple((c.name, c.arguments) for c in calls)))
    return out


def split_pieces(reader: type[CallReader], text: str) -> list[Any]:
    """The calls a ToolStream sent of `text` fed a character at a time."""
    stream = ToolStream(reader(), forced=False)
    pieces = [d for c in text for d in stream.feed(c)[1]] + stream.finish()[1]
    return merge_tool_calls(pieces)


def test_object_scanner_finds_values_at_any_split() -> None:
    text = '  {"a\\\"": "x}\\\"y", "n": {"b": ["}", {"c": "]"}], "d": -1.5e3}, "t": true} tail'
    whole = ObjectScanner(0)
    whole.scan(text)
    assert whole.done and text[whole.end :] == " tail"
    spans = {k: text[m.start : m.end] for k, m in whole.members.items()}
    assert json.loads(text[: whole.end]) == {k: json.loads(v) for k, v in spans.items()}
    assert spans["n"] == '{"b": ["}", {"c": "]"}], "d": -1.5e3}' and spans["t"] == "true"
    for cut in range(len(text)):  # a token at a time: same members, open ones without an end
        scanner = ObjectScanner(0)
        for i in range(cut + 1):
            scanner.scan(text[:i])
        scanner.scan(text)
        assert {k: (m.start, m.end) for k, m in scanner.members.items()} == {
            k: (m.start, m.end) for k, m in whole.members.items()}
    bad = ObjectScanner(0)
    bad.scan('{"a" 1}')
    assert bad.failed and not bad.done


def test_hermes_parser() -> None:
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": "}<tool_call>"}}\n</tool_call>'
    assert split_runs(HermesToolParser, text) == {("Sure. ", (("f", '{"a": "}<tool_call>"}'),))}
    two = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g"}'
    assert split_runs(HermesToolParser, two) == {("", (("f", "{}"), ("g", "{}")))}
    not_json = "<tool_call>not json</tool_call> ok"
    assert split_runs(HermesToolParser, not_json) == {(not_json, ())}
    late_name = '<tool_call>{"arguments": {"s": "\\u00e9\\""}, "name": "h"}</tool_call>'
    assert split_runs(HermesToolParser, late_name) == {("", (("h", '{"s": "\\u00e9\\""}'),))}
    as_text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert split_runs(HermesToolParser, as_text) == {("", (("f", '{"a": 1}'),))}
    assert split_runs(HermesToolParser, "It is sunny<tool_cal") == {("It is sunny<tool_cal", ())}
    stream = ToolStream(HermesToolParser(), forced=False)
    assert stream.feed("Hi <tool")[0] == "Hi " and stream.feed("_call>{")[0] == ""
    auto = RequestTools("auto", [], {})
    assert auto.calls(text, HermesToolParser)[1][0].arguments == '{"a": "}<tool_call>"}'
    cut = 'Hi <tool_call>{"name": "f", "arguments": {"a": "x'  # by max_tokens: stays content
    assert auto.calls(cut, HermesToolParser) == (cut, [])
    assert [c.arguments for c in split_pieces(HermesToolParser, cut)] == ['{"a": "x']


def test_llama3_json_parser() -> None:
    one = '<|python_tag|>{"name": "f", "parameters": {"x": [1, {"y": null}]}}'
    assert split_runs(Llama3JsonToolParser, one) == {("", (("f", '{"x": [1, {"y": null}]}'),))}
    two = '{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"k": 2}}'
    assert split_runs(Llama3JsonToolParser, two) == {("", (("f", "{}"), ("g", '{"k": 2}')))}
    for text in ("Hello {", '{"no": 1}', ' {"name": 3, "parameters": {}}'):
        assert split_runs(Llama3JsonToolParser, text) == {(text, ())}


def test_forced_readers_stream_the_arguments_as_written() -> None:
    text = '[{"name": "get_time", "arguments": {"zone": "U\\"TC"}}, {"name": "f", "arguments": {}}]'
    assert split_runs(ArrayCallReader, text, forced=True) == {
        ("", (("get_time", '{"zone": "U\\"TC"}'), ("f", "{}")))}
    named = '{"zone": "CET"}'
    assert split_runs(lambda: NamedCallReader("get_time"), named, forced=True) == {
        ("", (("get_time", named),))}
    stream = ToolStream(ArrayCallReader(), forced=True)
    firsts = [stream.feed(c)[1] for c in '[{"name": "f", "arguments": {"a": 1']
    pieces = [d.arguments for ds in firsts for d in ds]
    assert "".join(pieces) == '{"a": 1' and len(pieces) == 7
    refused = ToolStream(ArrayCallReader(), forced=True)  # no call in it: content at the end
    assert refused.feed('["f"') == ("", []) and refused.finish() == ('["f"', [])
