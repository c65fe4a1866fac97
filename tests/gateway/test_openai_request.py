"""Reading OpenAI request bodies: what is taken, ignored, refused, and the defaults."""

from __future__ import annotations

import logging

import pytest

from bucketserve.gateway.errors import InvalidArgumentError
from bucketserve.gateway.openai.serving import OpenAIFormat, parse_request
from bucketserve.gateway.tools.request_tools import RequestTools


def formatted(body: object, chat: bool) -> OpenAIFormat:
    """The response writer of `body`: what it takes of stream_options and logprobs."""
    req, inp = parse_request(body, chat)
    return OpenAIFormat(req, RequestTools.of(inp), "r", "m")


def test_completion_body() -> None:
    body = {
        "model": "m",
        "prompt": "Hello",
        "max_tokens": 7,
        "temperature": 0,
        "stop": "\n",
        "stream": True,
        "stream_options": {"include_usage": True},
        "top_k": 5,
        "priority": 2,
        "user": "someone",
        "n": 1,
        "logprobs": None,
    }
    req, inp = parse_request(body, chat=False)
    fmt = formatted(body, chat=False)
    assert (req.model, req.stream, fmt.include_usage, fmt.chat) == ("m", True, True, False)
    assert inp.prompt == "Hello"
    assert inp.sampling == {"max_tokens": 7, "temperature": 0, "stop": ["\n"], "top_k": 5}
    assert inp.priority == 2


def test_completion_defaults_to_sixteen_tokens_chat_to_the_rest_of_the_context() -> None:
    _, completion = parse_request({"prompt": "x"}, chat=False)
    assert completion.sampling == {"max_tokens": 16}
    _, chat = parse_request({"messages": [{"role": "user", "content": "x"}]}, chat=True)
    assert chat.sampling == {}


def test_chat_body_text_parts_developer_role_and_max_completion_tokens() -> None:
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    _, inp = parse_request(
        {
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": parts},
            ],
            "max_completion_tokens": 9,
            "max_tokens": 3,
            "response_format": {"type": "text"},
        },
        chat=True,
    )
    assert inp.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    assert inp.sampling["max_tokens"] == 9


def test_prompt_forms() -> None:
    assert parse_request({"prompt": [5, 6]}, False)[1].prompt_token_ids == [5, 6]
    assert parse_request({"prompt": ["one"]}, False)[1].prompt == "one"
    assert parse_request({"prompt": [[7]]}, False)[1].prompt_token_ids == [7]


BAD_BODIES = [
    # (body, chat, the whole message)
    ({"prompt": "x", "n": 17}, False,
     "n is 17; this server samples at most 16 choices per request (gateway.max_n)"),
    ({"prompt": "x", "echo": True, "logprobs": 21}, False,
     "logprobs is 21; this server returns at most 20 top logprobs per token "
     "(gateway.max_logprobs)"),
    ({"prompt": "x", "best_of": 2}, False,
     "best_of=2 is not supported yet by this server; leave it out or send 1"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, True,
     "tools[0].type is required; tools[0].function is required"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, True,
     "top_logprobs needs logprobs=true"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, True,
     "tool_choice needs tools; send the functions in tools"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, False,
     "response_format.json_schema.schema is required with type json_schema"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "pattern": "b"}}, False,
     "structured_outputs has unknown keys ['pattern']; known: ['json', 'json_object', "
     "'regex', 'choice', 'grammar', 'disable_any_whitespace', 'whitespace_pattern']"),
    # out of range, or of the wrong type, before "not supported"
    ({"prompt": "x", "n": 0}, False, "n must be >= 1, got 0"),
    ({"prompt": "x", "presence_penalty": 3}, False, "presence_penalty must be <= 2.0, got 3"),
    ({"prompt": "x", "repetition_penalty": 0}, False, "repetition_penalty must be > 0.0, got 0"),
    ({"prompt": "x", "min_p": -0.5}, False, "min_p must be >= 0.0, got -0.5"),
    ({"prompt": "x", "min_tokens": -1}, False, "min_tokens must be >= 0, got -1"),
    ({"prompt": "x", "logprobs": 21}, False,
     "logprobs is 21; this server returns at most 20 top logprobs per token "
     "(gateway.max_logprobs)"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 99}, True,
     "top_logprobs is 99; this server returns at most 20 top logprobs per token "
     "(gateway.max_logprobs)"),
    ({"prompt": "x", "n": "2"}, False, "n must be an integer, got '2'"),
    ({"prompt": "x", "temperature": "hot"}, False, "temperature must be a number, got 'hot'"),
    ({"prompt": "x", "max_tokens": 2.5}, False, "max_tokens must be an integer, got 2.5"),
    ({"prompt": "x", "max_tokens": 0}, False, "max_tokens must be >= 1, got 0"),
    ({"prompt": "x", "stream": "yes"}, False, "stream must be true or false, got 'yes'"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, False,
     "stream_options is only allowed with stream=true"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, False,
     "stream_options.include_usage must be true or false, got 1"),
    ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": "y"}}, False,
     "stream_options.continuous_usage_stats must be true or false, got 'y'"),
    ({"prompt": "x", "stop": 5}, False, "stop must be a string or a list of strings"),
    ({"prompt": ["a", "b"]}, False,
     "prompt must be a string or a list of token ids; send one prompt per request"),
    ({}, False, "prompt is required"),
    ({"messages": []}, True, "messages must have at least 1 item(s)"),
    ({"messages": ["hi"]}, True, "messages[0] must be an object, got 'hi'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True,
     'messages[0].content may only hold text parts ({"type": "text", "text": "..."})'),
    ({"messages": [{"content": "x"}]}, True, "messages[0].role is required"),
    ({"prompt": "x", "model": 3}, False, "model must be a string, got 3"),
    ([1, 2], False, "the request body must be a JSON object"),
    ('{"prompt": "x",', False,
     "the request body is not valid JSON: EOF while parsing a value at line 1 column 15"),
]


@pytest.mark.parametrize(("body", "chat", "message"), BAD_BODIES)
def test_bad_bodies(body: object, chat: bool, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        parse_request(body, chat)
    assert info.value.message == message


def test_n_and_echo_with_logprobs_become_sampling_fields() -> None:
    body = {"prompt": "x", "echo": True, "logprobs": 2, "n": 3}
    req, inp = parse_request(body, chat=False)
    assert (req.n, req.echo, formatted(body, chat=False).logprobs) == (3, True, 2)
    assert inp.sampling["n"] == 3 and inp.sampling["prompt_logprobs"] == 2
    _, plain = parse_request({"prompt": "x", "logprobs": 2}, chat=False)
    assert "prompt_logprobs" not in plain.sampling and "n" not in plain.sampling


def test_neutral_values_are_accepted() -> None:
    neutral = {"n": 1, "frequency_penalty": 0.0, "presence_penalty": 0, "logit_bias": {}}
    body = {"prompt": "x", "echo": False, "best_of": 1, "suffix": None, **neutral}
    assert parse_request(body, chat=False)[1].prompt == "x"


def test_vllm_bench_bodies_are_accepted() -> None:
    """What `vllm bench serve` sends with --backend vllm / openai, and openai-chat."""
    body = {
        "model": "m", "prompt": "Hi", "repetition_penalty": 1.0, "max_tokens": 8,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True, "temperature": 0.0,
    }
    assert parse_request(body, chat=False)[1].sampling == {
        "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "repetition_penalty": 1.0
    }
    completion = formatted(body, chat=False)
    assert (completion.include_usage, completion.continuous_usage) == (True, False)
    body = {
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "temperature": 0.0, "max_completion_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "min_tokens": 0, "min_p": 0.0, "n": 1,
    }
    assert parse_request(body, chat=True)[1].messages == [{"role": "user", "content": "Hi"}]
    chat = formatted(body, chat=True)
    assert (chat.include_usage, chat.continuous_usage) == (True, True)


def test_unknown_fields_are_ignored_with_a_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="bucketserve.gateway.openai.body")
    body = {
        "prompt": "x", "temprature": 0, "stream": True,
        "stream_options": {"include_usage": True, "chunk_size": 3},
    }
    _, inp = parse_request(body, chat=False)
    assert inp.sampling == {"max_tokens": 16}
    assert caplog.messages == [
        "CompletionRequest: ignoring unknown fields ['temprature', 'stream_options.chunk_size']"
    ]


def test_output_constraints_and_logit_bias_become_sampling_fields() -> None:
    schema = {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    _, inp = parse_request({"prompt": "x", "response_format": fmt, "logit_bias": {"7": 5}},
                           chat=False)
    assert inp.sampling["structured_outputs"] == {"json": schema}
    assert inp.structured_name == "response_format.json_schema.schema"
    assert inp.sampling["logit_bias"] == {"7": 5.0}
    _, guided = parse_request({"prompt": "x", "guided_choice": ["a", "b"]}, chat=False)
    assert guided.sampling["structured_outputs"] == {"choice": ["a", "b"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    named = {"type": "function", "function": {"name": "f"}}
    _, chat = parse_request(
        {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": named},
        chat=True,
    )
    assert chat.sampling["structured_outputs"] == {"json": schema}
    assert chat.tools == [tool]
