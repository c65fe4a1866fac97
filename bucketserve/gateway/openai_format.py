"""The JSON shapes of OpenAI responses, chunks and errors (bucketserve.gateway.openai_responses)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bucketserve.gateway.errors import BucketServeError
from bucketserve.gateway.openai_request import OpenAIRequest
from bucketserve.gateway.openai_responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprob,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    TopLogprob,
    UsageInfo,
)
from bucketserve.messages import StreamDelta
from bucketserve.runtime.core.logprobs import TokenLogprob

OPENAI_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}  # vLLM's "abort"


LOGPROB_FLOOR = -9999.0  # -inf (a token excluded) as JSON can carry it, as vLLM writes it
TokenText = Callable[[int], str]


class OpenAIFormat:
    """The OpenAI JSON shapes of one request's responses. `prompt_tokens` feeds the usage of
    every chunk when the client asked for continuous usage stats; `token_text(id)` is a
    token's text in logprobs; `prefix` (echo) comes before each choice's text."""

    def __init__(
        self,
        oai: OpenAIRequest,
        request_id: str,
        model: str,
        prompt_tokens: int = 0,
        token_text: TokenText | None = None,
        prefix: str = "",
    ) -> None:
        self.oai = oai
        self.id = f"{'chatcmpl' if oai.chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.token_text = token_text or str
        self.prefix = prefix
        self._offsets: dict[int, int] = {}  # choice -> its text's length so far (streaming)
        self._prompt: tuple[list[int], list[TokenLogprob | None]] | None = None

    def prompt(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None] | None
    ) -> None:
        """The prompt's tokens and logprobs, which an echo with logprobs starts each
        choice's logprobs with."""
        if self.prefix and logprobs is not None:
            self._prompt = (list(token_ids), list(logprobs))

    def _base(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model}

    def chunk(
        self,
        text: str | None = None,
        role: str | None = None,
        finish_reason: str | None = None,
        completion_tokens: int = 0,
        index: int = 0,
        token_ids: Sequence[int] = (),
        logprobs: Sequence[TokenLogprob | None] | None = None,
    ) -> str:
        """One `data:` event's JSON; its usage is the running count when asked for."""
        usage = (
            _usage(self.prompt_tokens, completion_tokens) if self.oai.continuous_usage else None
        )
        want = self.oai.logprobs is not None and logprobs is not None and bool(token_ids)
        if not self.oai.chat:
            start = self._offsets.get(index, 0)
            self._offsets[index] = start + len(text or "")
            lp = self._completion_logprobs(token_ids, logprobs, start) if want else None
            choice = CompletionChoice(
                index=index, text=text or "", logprobs=lp, finish_reason=finish_reason
            )
            out = CompletionResponse(**self._base(), choices=[choice], usage=usage)
            return out.model_dump_json()
        delta = DeltaMessage(role=role, content=text)
        lp = self._chat_logprobs(token_ids, logprobs) if want else None
        chunk = ChatCompletionChunk(
            **self._base(),
            choices=[
                ChatChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish_reason)
            ],
            usage=usage,
        )
        unset = {k for k, v in (("role", role), ("content", text)) if v is None}
        return chunk.model_dump_json(exclude={"choices": {0: {"delta": unset}}})

    def _completion_logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None], start: int
    ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        offset = start
        for token, lp in zip(token_ids, _padded(logprobs, len(token_ids)), strict=True):
            text = self.token_text(token)
            out.tokens.append(text)
            out.token_logprobs.append(None if lp is None else _finite(lp.logprob))
            out.top_logprobs.append(None if lp is None else self._top_dict(text, lp))
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _top_dict(self, text: str, lp: TokenLogprob) -> dict[str, float]:
        """The top k by token text, and the sampled token whether or not among them
        (vLLM's way; with logprobs=0 it is the only entry)."""
        top: dict[str, float] = {text: _finite(lp.logprob)}
        for token, value in lp.top:
            top.setdefault(self.token_text(token), _finite(value))
        return top

    def _chat_logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None]
    ) -> ChatChoiceLogprobs:
        content = []
        for token, lp in zip(token_ids, _padded(logprobs, len(token_ids)), strict=True):
            text = self.token_text(token)
            top = [] if lp is None else [self._top(t, v) for t, v in lp.top]
            value = LOGPROB_FLOOR if lp is None else _finite(lp.logprob)
            content.append(
                ChatLogprob(token=text, logprob=value, bytes=_bytes(text), top_logprobs=top)
            )
        return ChatChoiceLogprobs(content=content)

    def _top(self, token: int, value: float) -> TopLogprob:
        text = self.token_text(token)
        return TopLogprob(token=text, logprob=_finite(value), bytes=_bytes(text))

    @staticmethod
    def finish_reason(final: StreamDelta) -> str:
        return OPENAI_FINISH.get(final.finish_reason or "", "stop")

    def usage_chunk(self, final: StreamDelta) -> str:
        usage = _usage(final.num_prompt_tokens, final.num_output_tokens)
        cls = ChatCompletionChunk if self.oai.chat else CompletionResponse
        return cls(**self._base(), choices=[], usage=usage).model_dump_json()

    def whole(self, final: StreamDelta, text: str) -> dict[str, Any]:
        """The response of one choice, without logprobs."""
        return self.whole_choices([Finished(final, text)])

    def whole_choices(self, choices: Sequence[Finished]) -> dict[str, Any]:
        """The response of every choice (index i: choices[i]); usage is the request's final
        delta's: the prompt once and every choice's output."""
        final = choices[0].final
        usage = _usage(final.num_prompt_tokens, final.num_output_tokens)
        want = self.oai.logprobs is not None
        out: Any
        if self.oai.chat:
            chat = [
                ChatChoice(
                    index=i,
                    message=ChatMessageOut(content=c.text),
                    logprobs=self._chat_logprobs(c.token_ids, c.logprobs) if want else None,
                    finish_reason=self._reason(c),
                )
                for i, c in enumerate(choices)
            ]
            out = ChatCompletionResponse(**self._base(), choices=chat, usage=usage)
        else:
            completions = [
                CompletionChoice(
                    index=i,
                    text=self.prefix + c.text,
                    logprobs=self._whole_logprobs(c) if want else None,
                    finish_reason=self._reason(c),
                )
                for i, c in enumerate(choices)
            ]
            out = CompletionResponse(**self._base(), choices=completions, usage=usage)
        return out.model_dump()

    def _whole_logprobs(self, c: Finished) -> CompletionLogprobs:
        if self._prompt is None:
            return self._completion_logprobs(c.token_ids, c.logprobs, len(self.prefix))
        ids, logprobs = self._prompt
        return self._completion_logprobs([*ids, *c.token_ids], [*logprobs, *c.logprobs], 0)

    def _reason(self, c: Finished) -> str:
        return OPENAI_FINISH.get(c.finish_reason or c.final.finish_reason or "", "stop")


@dataclass
class Finished:
    """One finished choice: the request's final delta, the choice's whole text, tokens,
    their logprobs and its finish reason (default: the final delta's)."""

    final: StreamDelta
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: str | None = None


def _padded(logprobs: Sequence[TokenLogprob | None], n: int) -> list[TokenLogprob | None]:
    got = list(logprobs)[:n]
    return got + [None] * (n - len(got))


def _finite(value: float) -> float:
    return LOGPROB_FLOOR if math.isnan(value) else max(value, LOGPROB_FLOOR)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _usage(prompt: int, completion: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def error_body(error: BucketServeError) -> dict[str, Any]:
    """OpenAI's error object for a BucketServeError."""
    info = ErrorInfo(message=error.message, type=error.openai_type, code=error.http_status)
    return ErrorResponse(error=info).model_dump()
