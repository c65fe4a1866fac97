"""Reading OpenAI request bodies: what is taken, ignored, refused, and the defaults."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidArgumentError
from gateway.openai_request import OpenAIRequest


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


@pytest.mark.parametrize(
    ("body", "chat", "message"),
    [
        ({"prompt": "x", "temprature": 0}, False, r"unknown fields \['temprature'\]"),
        ({"prompt": "x", "messages": []}, False, r"unknown fields \['messages'\]"),
        ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, True, "unknown"),
        ({"prompt": "x", "n": 2}, False, "n=2 is not supported"),
        ({"prompt": "x", "logprobs": 3}, False, "logprobs=3 is not supported"),
        ({"prompt": "x", "echo": True}, False, "echo=True is not supported"),
        ({"prompt": "x", "frequency_penalty": 0.5}, False, "frequency_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, True, "tools"),
        ({"prompt": "x", "stream": "yes"}, False, "stream must be true or false"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, False, "only allowed"),
        ({"prompt": "x", "stream": True, "stream_options": {"x": 1}}, False, "stream_options"),
        ({"prompt": ["a", "b"]}, False, "one prompt per request"),
        ({}, False, "prompt is required"),
        ({"messages": []}, True, "non-empty list"),
        ({"messages": ["hi"]}, True, r"messages\[0\] must be an object"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, "text parts"),
        ({"prompt": "x", "model": 3}, False, "model must be a string"),
        ([1, 2], False, "JSON object"),
    ],
)
def test_bad_bodies(body: object, chat: bool, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        OpenAIRequest.parse(body, chat)


def test_neutral_values_are_accepted() -> None:
    neutral = {"n": 1, "frequency_penalty": 0.0, "presence_penalty": 0, "logit_bias": {}}
    body = {"prompt": "x", "echo": False, "best_of": 1, "suffix": None, **neutral}
    assert OpenAIRequest.parse(body, chat=False).input.prompt == "x"
