"""An OpenAI `/v1/completions` or `/v1/chat/completions` body, checked and read.

Unknown keys: vLLM accepts and ignores keys it does not know; we are stricter,
so a typo never silently changes nothing. A key is accepted when it is
- implemented (the sampling keys, `stream`, `stream_options`, `model`),
- one of ours (vLLM's extra sampling keys and bucketserve's priority / SLO
  hints, see OURS),
- an OpenAI key that cannot change the output (IGNORED: `user`, `metadata`...),
- or an OpenAI key we do not implement, at its neutral value only (NEUTRAL:
  `n=1`, `logprobs=null`, `frequency_penalty=0`...); another value is a 400
  saying it is not supported.
Any other key is a 400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidArgumentError
from gateway.generate_input import GenerateInput

SAMPLING = ("max_tokens", "temperature", "top_p", "stop", "seed")
OURS = (
    "top_k",
    "ignore_eos",
    "stop_token_ids",
    "priority",
    "request_id",
    "ttft_slo_s",
    "tpot_slo_s",
)
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
_NULL = (None,)
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
}
COMPLETION_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": _NULL,
}
CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_logprobs": (None, 0),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": _NULL,
    "function_call": _NULL,
    "modalities": (None, ["text"]),
    "audio": _NULL,
    "prediction": _NULL,
    "reasoning_effort": _NULL,
    "web_search_options": _NULL,
}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's; chat defaults to the rest of the context


@dataclass
class OpenAIRequest:
    input: GenerateInput
    chat: bool
    model: str | None = None
    stream: bool = False
    include_usage: bool = False

    @classmethod
    def parse(cls, body: Any, chat: bool) -> OpenAIRequest:
        if not isinstance(body, dict):
            raise InvalidArgumentError("the request body must be a JSON object")
        _check_keys(body, chat)
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise InvalidArgumentError(f"stream must be true or false, got {stream!r}")
        return cls(
            input=_input(body, chat),
            chat=chat,
            model=_optional_str(body, "model"),
            stream=stream,
            include_usage=_include_usage(body.get("stream_options"), stream),
        )


def _check_keys(body: dict[str, Any], chat: bool) -> None:
    neutral = {**NEUTRAL, **(CHAT_NEUTRAL if chat else COMPLETION_NEUTRAL)}
    own = ("messages", "max_completion_tokens") if chat else ("prompt",)
    known = {*own, *SAMPLING, *OURS, *IGNORED, *neutral, "model", "stream", "stream_options"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidArgumentError(
            f"unknown fields {unknown}; this endpoint takes OpenAI's fields plus {list(OURS)}"
        )
    for key, allowed in neutral.items():
        if key in body and not any(_same(body[key], a) for a in allowed):
            raise InvalidArgumentError(
                f"{key}={body[key]!r} is not supported by this server; leave it out"
            )


def _same(value: Any, allowed: Any) -> bool:
    if allowed is None or isinstance(allowed, bool):
        return value is allowed
    if isinstance(allowed, int):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == allowed
    return value == allowed


def _input(body: dict[str, Any], chat: bool) -> GenerateInput:
    keys = (*SAMPLING, "top_k", "ignore_eos", "stop_token_ids")
    sampling = {k: body[k] for k in keys if body.get(k) is not None}
    if chat:
        if body.get("max_completion_tokens") is not None:
            sampling["max_tokens"] = body["max_completion_tokens"]
    else:
        sampling.setdefault("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    inp = GenerateInput(
        sampling=sampling,
        request_id=_optional_str(body, "request_id"),
        priority=body.get("priority", 0),
        slo_ttft_s=body.get("ttft_slo_s"),
        slo_tpot_s=body.get("tpot_slo_s"),
    )
    if chat:
        inp.messages = _messages(body.get("messages"))
    else:
        _prompt(body.get("prompt"), inp)
    return inp


def _prompt(prompt: Any, inp: GenerateInput) -> None:
    """A string, a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        inp.prompt = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        inp.prompt_token_ids = prompt
    elif prompt is None:
        raise InvalidArgumentError("prompt is required")
    else:
        raise InvalidArgumentError(
            "prompt must be a string or a list of token ids; send one prompt per request"
        )


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidArgumentError(f"messages[{i}] must be an object with role and content")
        role = "system" if m.get("role") == "developer" else m.get("role")
        out.append({"role": role, "content": _content(m.get("content"), i)})
    return out


def _content(content: Any, i: int) -> Any:
    """Text, or a list of text parts joined; other part types are refused."""
    if not isinstance(content, list):
        return content
    if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        raise InvalidArgumentError(f"messages[{i}].content: only text parts are supported")
    return "".join(str(p.get("text", "")) for p in content)


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise InvalidArgumentError("stream_options is only allowed with stream=true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise InvalidArgumentError('stream_options must be {"include_usage": true|false}')
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise InvalidArgumentError("stream_options.include_usage must be true or false")
    return include


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidArgumentError(f"{key} must be a string, got {value!r}")
    return value
