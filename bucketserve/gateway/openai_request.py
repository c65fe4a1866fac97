"""An OpenAI `/v1/completions` or `/v1/chat/completions` body, read into a GenerateInput.

Types and ranges are the pydantic models' (bucketserve.gateway.openai_protocol); a field this server
does not implement yet is refused unless it holds its neutral value, so no request is
silently served differently from what it asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bucketserve.gateway.errors import InvalidArgumentError
from bucketserve.gateway.generate_input import GenerateInput
from bucketserve.gateway.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from bucketserve.gateway.request_body import parse_body

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's; chat defaults to the rest of the context
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
            "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "min_p", "min_tokens")
Body = CompletionRequest | ChatCompletionRequest


@dataclass
class OpenAIRequest:
    input: GenerateInput
    chat: bool
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage in every chunk (vLLM's continuous_usage_stats)
    n: int = 1  # choices: samples of the prompt, prefilled once (SamplingParams.n)
    logprobs: int | None = None  # top logprobs per token (0: the sampled token's only)
    echo: bool = False  # completions: the prompt's text (and logprobs) before the output

    @classmethod
    def parse(cls, body: str | bytes | Any, chat: bool) -> OpenAIRequest:
        """`body` as JSON text or decoded JSON; InvalidArgumentError naming the field."""
        req: Body = parse_body(ChatCompletionRequest if chat else CompletionRequest, body)
        _check_neutral(req)
        options = req.stream_options
        if options is not None and not req.stream:
            raise InvalidArgumentError("stream_options is only allowed with stream=true")
        include_usage = options is not None and options.include_usage
        logprobs = _logprobs(req)
        inp = _input(req)
        if logprobs is not None:
            inp.sampling["logprobs"] = logprobs
        echo = isinstance(req, CompletionRequest) and req.echo
        if echo and logprobs is not None:  # the prompt's tokens come with theirs (vLLM's way)
            inp.sampling["prompt_logprobs"] = logprobs
        if req.n != 1:
            inp.sampling["n"] = req.n
        return cls(
            input=inp,
            n=req.n,
            logprobs=logprobs,
            echo=echo,
            chat=chat,
            model=req.model,
            stream=req.stream,
            include_usage=include_usage,
            continuous_usage=include_usage and options is not None
            and options.continuous_usage_stats,
        )


def _check_neutral(req: Body) -> None:
    for name, neutral in type(req).NEUTRAL.items():
        value = getattr(req, name)
        if value not in neutral:
            raise InvalidArgumentError(
                f"{name}={value!r} is not supported yet by this server; leave it out or "
                f"send {neutral[-1]!r}"
            )


def _logprobs(req: Body) -> int | None:
    """How many top logprobs each output token carries (None: no logprobs)."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidArgumentError("top_logprobs needs logprobs=true")
    return (req.top_logprobs or 0) if req.logprobs else None


def _input(req: Body) -> GenerateInput:
    sampling = req.model_dump(include=set(SAMPLING), exclude_none=True, exclude_unset=True)
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    inp = GenerateInput(
        sampling=sampling,
        request_id=req.request_id,
        priority=req.priority,
        slo_ttft_s=req.ttft_slo_s,
        slo_tpot_s=req.tpot_slo_s,
    )
    if isinstance(req, ChatCompletionRequest):
        if req.max_completion_tokens is not None:
            sampling["max_tokens"] = req.max_completion_tokens
        inp.messages = chat_messages(req.messages)
        return inp
    sampling.setdefault("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    if isinstance(req.prompt, str):
        inp.prompt = req.prompt
    else:
        inp.prompt_token_ids = list(req.prompt)  # type: ignore[arg-type]
    return inp


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Text parts joined; OpenAI's `developer` role is the template's `system`."""
    return [
        {
            "role": "system" if m.role == "developer" else m.role,
            "content": "".join(p.text for p in m.content)
            if isinstance(m.content, list)
            else m.content,
        }
        for m in messages
    ]
