"""The JSON shapes of OpenAI responses, chunks and errors (gateway.openai_responses)."""

from __future__ import annotations

import time
from typing import Any

from gateway.errors import BucketServeError
from gateway.openai_request import OpenAIRequest
from gateway.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    UsageInfo,
)
from kv_worker.messages import StreamDelta

OPENAI_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}  # vLLM's "abort"


class OpenAIFormat:
    """The OpenAI JSON shapes of one request's responses. `prompt_tokens` feeds the usage of
    every chunk when the client asked for continuous usage stats."""

    def __init__(
        self, oai: OpenAIRequest, request_id: str, model: str, prompt_tokens: int = 0
    ) -> None:
        self.oai = oai
        self.id = f"{'chatcmpl' if oai.chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens

    def _base(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model}

    def chunk(
        self,
        text: str | None = None,
        role: str | None = None,
        finish_reason: str | None = None,
        completion_tokens: int = 0,
    ) -> str:
        """One `data:` event's JSON; its usage is the running count when asked for."""
        usage = (
            _usage(self.prompt_tokens, completion_tokens) if self.oai.continuous_usage else None
        )
        if not self.oai.chat:
            choice = CompletionChoice(text=text or "", finish_reason=finish_reason)
            out = CompletionResponse(**self._base(), choices=[choice], usage=usage)
            return out.model_dump_json()
        delta = DeltaMessage(role=role, content=text)
        chunk = ChatCompletionChunk(
            **self._base(),
            choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)],
            usage=usage,
        )
        unset = {k for k, v in (("role", role), ("content", text)) if v is None}
        return chunk.model_dump_json(exclude={"choices": {0: {"delta": unset}}})

    @staticmethod
    def finish_reason(final: StreamDelta) -> str:
        return OPENAI_FINISH.get(final.finish_reason or "", "stop")

    def usage_chunk(self, final: StreamDelta) -> str:
        usage = _usage(final.num_prompt_tokens, final.num_output_tokens)
        cls = ChatCompletionChunk if self.oai.chat else CompletionResponse
        return cls(**self._base(), choices=[], usage=usage).model_dump_json()

    def whole(self, final: StreamDelta, text: str) -> dict[str, Any]:
        reason = self.finish_reason(final)
        usage = _usage(final.num_prompt_tokens, final.num_output_tokens)
        out: Any
        if self.oai.chat:
            choice = ChatChoice(message=ChatMessageOut(content=text), finish_reason=reason)
            out = ChatCompletionResponse(**self._base(), choices=[choice], usage=usage)
        else:
            choice = CompletionChoice(text=text, finish_reason=reason)
            out = CompletionResponse(**self._base(), choices=[choice], usage=usage)
        return out.model_dump()


def _usage(prompt: int, completion: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def error_body(error: BucketServeError) -> dict[str, Any]:
    """OpenAI's error object for a BucketServeError."""
    info = ErrorInfo(message=error.message, type=error.openai_type, code=error.http_status)
    return ErrorResponse(error=info).model_dump()
