"""OpenAI tools: `required` and a named function constrain the output to the tools' schemas,
`auto` reads calls out of the text with the configured parser (a hermes-style template
renders the tools), streamed deltas add up to the same calls, and tool history renders."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from bucketserve.gateway.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser
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


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def streamed(client: openai.OpenAI, **body: Any) -> tuple[str, list[tuple[str, Any]], str]:
    """(content, calls, finish_reason) assembled from a stream's deltas."""
    content, finish = "", ""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert all(c["id"] for c in calls.values())
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return content, got, finish


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
    jsonschema.validate(calls[0][1], SCHEMAS[calls[0][0]])
    assert choice.message.tool_calls[0].id.startswith("call_")
    content, stream_calls, finish = streamed(client, **body)
    assert (content, stream_calls, finish) == ("", calls, "tool_calls")

    named = {**body, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    out = client.chat.completions.create(**named)
    calls = calls_of(out.choices[0].message)
    assert [name for name, _ in calls] == ["get_time"]
    jsonschema.validate(calls[0][1], TIME)
    assert streamed(client, **named) == ("", calls, "tool_calls")


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
    jsonschema.validate(calls[0][1], WEATHER)
    assert streamed(client, **body) == ("", calls, "tool_calls")

    text = {**base, "tools": TOOLS, "extra_body": {"guided_regex": "It is sunny<tool_cal"}}
    out = client.chat.completions.create(**text)
    assert out.choices[0].message.content == "It is sunny<tool_cal"
    assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason == "stop"
    assert streamed(client, **text) == ("It is sunny<tool_cal", [], "stop")


@pytest.mark.smollm
@pytest.mark.slow
def test_tool_history_renders_and_auto_without_a_parser_is_a_400(
    hermes: Any, loop_thread: Any
) -> None:
    server, controller = hermes
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
    bare = start_server(loop_thread, controller)  # no model.tool_call_parser
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


def test_hermes_parser() -> None:
    p = HermesToolParser()
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert p.extract(text) == ("Sure. ", [("f", '{"a": 1}')])
    two = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"}'
    assert p.extract(two) == (None, [("f", "{}"), ("g", "{}")])
    assert p.extract("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert (p.held("Hi <tool"), p.held("Hi <tool_call>{"), p.held("Hi <b>")) == (5, 12, 0)


def test_llama3_json_parser() -> None:
    p = Llama3JsonToolParser()
    assert p.extract('{"name": "f", "parameters": {"x": "y"}}') == (None, [("f", '{"x": "y"}')])
    assert p.extract('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}') == (
        None, [("f", "{}"), ("g", "{}")])
    assert p.extract("Hello {") == ("Hello {", [])
    assert p.extract('{"no": 1}') == ('{"no": 1}', [])
    assert (p.held(' {"na'), p.held("Hello")) == (5, 0)
