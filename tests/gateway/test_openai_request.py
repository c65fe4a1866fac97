"""Reading OpenAI request bodies: what is taken, ignored, refused, and the defaults."""

from __future__ import annotations

import logging

import pytest

from bucketserve.gateway.errors import InvalidArgumentError
from bucketserve.gateway.openai.serving import OpenAIRequest


def test_completion_body() -> None:
    req = OpenAIRequest.parse(
        {
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
        },
        chat=False,
    )
    assert (req.model, req.stream, req.include_usage, req.chat) == ("m", True, True, False)
    assert req.input.prompt == "Hello"
    assert req.input.sampling == {"max_tokens": 7, "temperature": 0, "stop": ["\n"], "top_k": 5}
    assert req.input.priority == 2


def test_completion_defaults_to_sixteen_tokens_chat_to_the_rest_of_the_context() -> None:
    completion = OpenAIRequest.parse({"prompt": "x"}, chat=False)
    assert completion.input.sampling == {"max_tokens": 16}
    chat = OpenAIRequest.parse({"messages": [{"role": "user", "content": "x"}]}, chat=True)
    assert chat.input.sampling == {}


def test_chat_body_text_parts_developer_role_and_max_completion_tokens() -> None:
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    req = OpenAIRequest.parse(
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
    assert req.input.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    assert req.input.sampling["max_tokens"] == 9


def test_prompt_forms() -> None:
    assert OpenAIRequest.parse({"prompt": [5, 6]}, False).input.prompt_token_ids == [5, 6]
    assert OpenAIRequest.parse({"prompt": ["one"]}, False).input.prompt == "one"
    assert OpenAIRequest.parse({"prompt": [[7]]}, False).input.prompt_token_ids == [7]


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
        OpenAIRequest.parse(body, chat)
    assert info.value.message == message


def test_n_and_echo_with_logprobs_become_sampling_fields() -> None:
    req = OpenAIRequest.parse({"prompt": "x", "echo": True, "logprobs": 2, "n": 3}, chat=False)
    assert (req.n, req.echo, req.logprobs) == (3, True, 2)
    assert req.input.sampling["n"] == 3 and req.input.sampling["prompt_logprobs"] == 2
    plain = OpenAIRequest.parse({"prompt": "x", "logprobs": 2}, chat=False)
    assert "prompt_logprobs" not in plain.input.sampling and "n" not in plain.input.sampling


def test_neutral_values_are_accepted() -> None:
    neutral = {"n": 1, "frequency_penalty": 0.0, "presence_penalty": 0, "logit_bias": {}}
    body = {"prompt": "x", "echo": False, "best_of": 1, "suffix": None, **neutral}
    assert OpenAIRequest.parse(body, chat=False).input.prompt == "x"


def test_vllm_bench_bodies_are_accepted() -> None:
    """What `vllm bench serve` sends with --backend vllm / openai, and openai-chat."""
    completion = OpenAIRequest.parse(
        {
            "model": "m", "prompt": "Hi", "repetition_penalty": 1.0, "max_tokens": 8,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0.0,
        },
        chat=False,
    )
    assert completion.input.sampling == {
        "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "repetition_penalty": 1.0
    }
    assert (completion.include_usage, completion.continuous_usage) == (True, False)
    chat = OpenAIRequest.parse(
        {
            "model": "m", "messages": [{"role": "user", "content": [{"type": "text",
                                                                    "text": "Hi"}]}],
            "temperature": 0.0, "max_completion_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "min_tokens": 0, "min_p": 0.0, "n": 1,
        },
        chat=True,
    )
    assert chat.input.messages == [{"role": "user", "content": "Hi"}]
    assert (chat.include_usage, chat.continuous_usage) == (True, True)


def test_unknown_fields_are_ignored_with_a_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="bucketserve.gateway.openai.body")
    body = {
        "prompt": "x", "temprature": 0, "stream": True,
        "stream_options": {"include_usage": True, "chunk_size": 3},
    }
    req = OpenAIRequest.parse(body, chat=False)
    assert req.input.sampling == {"max_tokens": 16}
    assert caplog.messages == [
        "CompletionRequest: ignoring unknown fields ['temprature', 'stream_options.chunk_size']"
    ]


def test_output_constraints_and_logit_bias_become_sampling_fields() -> None:
    schema = {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    req = OpenAIRequest.parse({"prompt": "x", "response_format": fmt, "logit_bias": {"7": 5}},
                              chat=False)
    assert req.input.sampling["structured_outputs"] == {"json": schema}
    assert req.input.structured_name == "response_format.json_schema.schema"
    assert req.input.sampling["logit_bias"] == {"7": 5.0}
    guided = OpenAIRequest.parse({"prompt": "x", "guided_choice": ["a", "b"]}, chat=False)
    assert guided.input.sampling["structured_outputs"] == {"choice": ["a", "b"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    named = {"type": "function", "function": {"name": "f"}}
    chat = OpenAIRequest.parse(
        {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": named},
        chat=True,
    )
    assert chat.input.sampling["structured_outputs"] == {"json": schema}
    assert chat.input.tools == [tool]
