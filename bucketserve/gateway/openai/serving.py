"""OpenAI bodies to the gateway's types and back: a `/v1/completions` or
`/v1/chat/completions` body read into a GenerateInput (parse_request), and a request's
StreamDeltas written as OpenAI responses, SSE events and errors (OpenAIFormat).

A field this server does not implement yet is refused unless it holds its neutral value,
so no request is silently served differently from what it asked.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from bucketserve.gateway.errors import BucketServeError, GenerationError, InvalidArgumentError
from bucketserve.gateway.generate_input import GenerateInput
from bucketserve.gateway.generation import Choice
from bucketserve.gateway.openai.body import parse_body
from bucketserve.gateway.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatMessage,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    FunctionCallOut,
    NamedToolChoice,
    PromptTokensDetails,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
    not_supported,
)
from bucketserve.gateway.request_limits import RequestLimits
from bucketserve.gateway.sdk_types import ToolCall
from bucketserve.gateway.tools.call_reader import CallReader
from bucketserve.gateway.tools.request_tools import RequestTools
from bucketserve.gateway.tools.tool_stream import ToolStream
from bucketserve.messages import StreamDelta
from bucketserve.runtime.core.logprobs import TokenLogprob

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's; chat defaults to the rest of the context
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
            "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "min_p", "min_tokens", "skip_special_tokens")
OPENAI_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}  # vLLM's "abort"
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # vLLM's older names -> StructuredOutputsParams'
STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace",
                   "whitespace_pattern")
LOGPROB_FLOOR = -9999.0  # -inf (a token excluded) as JSON can carry it, as vLLM writes it
Body = CompletionRequest | ChatCompletionRequest
TokenText = Callable[[int], str]
Logprobs = Sequence[TokenLogprob | None]


def parse_request(
    body: str | bytes | Any, chat: bool, limits: RequestLimits | None = None
) -> tuple[Body, GenerateInput]:
    """`body` (JSON text or decoded JSON, its lists and texts within `limits`, the defaults
    if None) validated, and the GenerateInput admission takes of it; InvalidArgumentError
    naming the field."""
    model = ChatCompletionRequest if chat else CompletionRequest
    req: Body = parse_body(model, body, limits)
    _check_neutral(req)
    if req.stream_options is not None and not req.stream:
        raise InvalidArgumentError("stream_options is only allowed with stream=true")
    logprobs = _logprobs(req)
    inp = _input(req)
    if logprobs is not None:
        inp.sampling["logprobs"] = logprobs
    echo = isinstance(req, CompletionRequest) and req.echo
    if echo and logprobs is not None:  # the prompt's tokens come with theirs (vLLM's way)
        inp.sampling["prompt_logprobs"] = logprobs
    if req.n != 1:
        inp.sampling["n"] = req.n
    if req.logit_bias:
        inp.sampling["logit_bias"] = dict(req.logit_bias)
    tools = _tools(req, inp) if isinstance(req, ChatCompletionRequest) else None
    _structured(req, inp, tools)
    return req, inp


def _check_neutral(req: Body) -> None:
    for name, neutral in type(req).NEUTRAL.items():
        value = getattr(req, name)
        if value not in neutral:
            raise not_supported(name, value, neutral)


def _tools(req: ChatCompletionRequest, inp: GenerateInput) -> RequestTools | None:
    inp.tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or ()] or None
    if isinstance(req.tool_choice, NamedToolChoice):
        inp.tool_function = req.tool_choice.function.name
    else:
        inp.tool_choice = req.tool_choice
    inp.parallel_tool_calls = req.parallel_tool_calls
    return RequestTools.of(inp)


def _structured(req: Body, inp: GenerateInput, tools: RequestTools | None) -> None:
    """The one output constraint the body asks for, if any, into `inp.sampling` (compiled,
    and so checked, at admission); `inp.structured_name` is the field it came from."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidArgumentError(
                "response_format.json_schema.schema is required with type json_schema"
            )
        given.append(("response_format.json_schema.schema", {"json": fmt.json_schema.schema_}))
    if req.structured_outputs is not None:
        unknown = sorted(set(req.structured_outputs) - set(STRUCTURED_KEYS))
        if unknown:
            raise InvalidArgumentError(
                f"structured_outputs has unknown keys {unknown}; known: {list(STRUCTURED_KEYS)}"
            )
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for name, kind in GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            given.append((name, {kind: value}))
    if tools is not None and tools.forced:
        given.append(("tools", {"json": tools.schema()}))
    if len(given) > 1:
        raise InvalidArgumentError(
            "give at most one output constraint (response_format, structured_outputs, "
            f"guided_*, or tool_choice required / a named function); got {[n for n, _ in given]}"
        )
    if req.guided_whitespace_pattern is not None:
        if not given:
            raise InvalidArgumentError(
                "guided_whitespace_pattern shapes JSON output: give it with a JSON constraint"
            )
        given[0][1]["whitespace_pattern"] = req.guided_whitespace_pattern
    if given:
        inp.structured_name, inp.sampling["structured_outputs"] = given[0]


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
        cache_salt=req.cache_salt,
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
    """Text parts joined; OpenAI's `developer` role is the template's `system`; an
    assistant's tool calls and a tool message's call id and name kept for the template."""
    out = []
    for m in messages:
        message: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": "".join(p.text for p in m.content)
            if isinstance(m.content, list)
            else m.content,
        }
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        out.append(message)
    return out


class OpenAIFormat:
    """The OpenAI JSON of one request's responses, as its validated `body` asks for them
    (`tools`: a chat body's, read from its GenerateInput). `prompt_tokens` feeds the usage
    of every chunk when the client asked for continuous usage stats; `token_text(id)` is a
    token's text in logprobs; `prefix` (echo) comes before each choice's text."""

    def __init__(
        self,
        body: Body,
        tools: RequestTools | None,
        request_id: str,
        model: str,
        prompt_tokens: int = 0,
        token_text: TokenText | None = None,
        prefix: str = "",
        tool_parser: type[CallReader] | None = None,
    ) -> None:
        self.chat = isinstance(body, ChatCompletionRequest)
        options = body.stream_options
        self.include_usage = options is not None and options.include_usage
        # usage in every chunk (vLLM's continuous_usage_stats)
        self.continuous_usage = self.include_usage and options.continuous_usage_stats
        self.logprobs = _logprobs(body)  # top logprobs per token (0: the sampled token's only)
        self.tools = tools
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.token_text = token_text or str
        self.prefix = prefix
        self._offsets: dict[int, int] = {}  # choice -> its text's length so far (streaming)
        self.tool_parser = tool_parser
        self._calls = tools is not None and tools.stream(tool_parser) is not None
        self._tool_streams: dict[int, ToolStream] = {}

    def opening(
        self, n: int, prompt_ids: Sequence[int], prompt_logprobs: Logprobs | None
    ) -> list[str]:
        """The events before the first delta: each chat choice's role, or each completion
        choice's echoed prompt."""
        if self.chat:
            return [self._chunk(role="assistant", text="", index=i) for i in range(n)]
        if not self.prefix:
            return []
        return [
            self._chunk(text=self.prefix, index=i, token_ids=prompt_ids, logprobs=prompt_logprobs)
            for i in range(n)
        ]

    def events(self, delta: StreamDelta, completion_tokens: int) -> list[str]:
        """One delta's events: its text, its choice's end (or error), then the usage after
        the request's final delta when asked for. `completion_tokens`: the choice's so far."""
        out = []
        index = delta.index
        if self._calls:
            return self._tool_events(delta, completion_tokens)
        if delta.text or (delta.logprobs and delta.token_ids):
            out.append(
                self._chunk(
                    text=delta.text,
                    completion_tokens=completion_tokens,
                    index=index,
                    token_ids=delta.token_ids,
                    logprobs=delta.logprobs,
                )
            )
        out += self._ending(delta, completion_tokens)
        return out

    def _tool_events(self, delta: StreamDelta, completion_tokens: int) -> list[str]:
        """A choice that may call tools: its content once it is sure not to be a call, each
        call's arguments as the model writes them."""
        index = delta.index
        stream = self._tool_streams.get(index)
        if stream is None:
            assert self.tools is not None
            stream = self._tool_streams[index] = self.tools.stream(self.tool_parser)
            assert stream is not None
        text, calls = stream.feed(delta.text)
        if delta.finish_reason is not None and delta.finish_reason != "error":
            rest, more = stream.finish()
            text, calls = text + rest, calls + more
        out = []
        if text:
            out.append(self._chunk(text=text, completion_tokens=completion_tokens, index=index))
        if calls:
            deltas = [_delta_tool_call(c) for c in calls]
            out.append(
                self._chunk(tool_calls=deltas, completion_tokens=completion_tokens, index=index)
            )
        return out + self._ending(delta, completion_tokens, stream.called)

    def _ending(self, delta: StreamDelta, completion_tokens: int, calls: bool = False) -> list[str]:
        """A choice's end (or error), then the usage after the request's final delta."""
        out = []
        index = delta.index
        if delta.finish_reason == "error":
            out.append(error_event(GenerationError(f"generation failed: {delta.error}")))
        elif delta.finish_reason is not None:
            reason = _finish_reason(delta.finish_reason, calls)
            out.append(
                self._chunk(finish_reason=reason, completion_tokens=completion_tokens, index=index)
            )
        if delta.finished and self.include_usage:
            usage = _final_usage(delta)
            cls = ChatCompletionChunk if self.chat else CompletionResponse
            out.append(cls(**self._base(), choices=[], usage=usage).model_dump_json())
        return out

    def _chunk(
        self,
        text: str | None = None,
        role: str | None = None,
        finish_reason: str | None = None,
        completion_tokens: int = 0,
        index: int = 0,
        token_ids: Sequence[int] = (),
        logprobs: Logprobs | None = None,
        tool_calls: list[DeltaToolCall] | None = None,
    ) -> str:
        """One `data:` event's JSON; its usage is the running count when asked for."""
        usage = (
            _usage(self.prompt_tokens, completion_tokens) if self.continuous_usage else None
        )
        want = self.logprobs is not None and logprobs is not None and bool(token_ids)
        if not self.chat:
            start = self._offsets.get(index, 0)
            self._offsets[index] = start + len(text or "")
            lp = self._completion_logprobs(token_ids, logprobs, start) if want else None
            choice = CompletionChoice(
                index=index, text=text or "", logprobs=lp, finish_reason=finish_reason
            )
            out = CompletionResponse(**self._base(), choices=[choice], usage=usage)
            return out.model_dump_json()
        delta = DeltaMessage(role=role, content=text, tool_calls=tool_calls)
        lp = self._chat_logprobs(token_ids, logprobs) if want else None
        chunk = ChatCompletionChunk(
            **self._base(),
            choices=[
                ChatChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish_reason)
            ],
            usage=usage,
        )
        given = (("role", role), ("content", text), ("tool_calls", tool_calls))
        unset = {k for k, v in given if v is None}
        return chunk.model_dump_json(exclude={"choices": {0: {"delta": unset}}})

    def response(
        self,
        final: StreamDelta,
        choices: Sequence[Choice],
        prompt_ids: Sequence[int],
        prompt_logprobs: Logprobs | None,
    ) -> dict[str, Any]:
        """The whole response (index i: choices[i]); usage is the request's final delta's:
        the prompt once and every choice's output. An echo with logprobs starts each
        choice's logprobs with the prompt's."""
        usage = _final_usage(final)
        want = self.logprobs is not None
        out: Any
        if self.chat:
            chat = [
                self._chat_choice(i, c, final.finish_reason, want) for i, c in enumerate(choices)
            ]
            out = ChatCompletionResponse(**self._base(), choices=chat, usage=usage)
        else:
            echoed = prompt_logprobs if self.prefix else None
            completions = [
                CompletionChoice(
                    index=i,
                    text=self.prefix + c.text,
                    logprobs=self._choice_logprobs(c, prompt_ids, echoed) if want else None,
                    finish_reason=_finish_reason(c.finish_reason or final.finish_reason),
                )
                for i, c in enumerate(choices)
            ]
            out = CompletionResponse(**self._base(), choices=completions, usage=usage)
        return out.model_dump()

    def _chat_choice(self, i: int, c: Choice, final_reason: str | None, want: bool) -> ChatChoice:
        content: str | None = c.text
        calls: list[ToolCall] = []
        if self._calls and self.tools is not None:
            content, calls = self.tools.calls(c.text, self.tool_parser)
        out = [
            ToolCallOut(id=x.id, function=FunctionCallOut(name=x.name, arguments=x.arguments))
            for x in calls
        ]
        return ChatChoice(
            index=i,
            message=ChatMessageOut(content=content, tool_calls=out),
            logprobs=self._chat_logprobs(c.token_ids, c.logprobs) if want else None,
            finish_reason=_finish_reason(c.finish_reason or final_reason, bool(calls)),
        )

    def _base(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model}

    def _choice_logprobs(
        self, c: Choice, prompt_ids: Sequence[int], prompt_logprobs: Logprobs | None
    ) -> CompletionLogprobs:
        """A completion choice's logprobs, after the echoed prompt's when it has them."""
        if prompt_logprobs is None:
            return self._completion_logprobs(c.token_ids, c.logprobs, len(self.prefix))
        return self._completion_logprobs(
            [*prompt_ids, *c.token_ids], [*prompt_logprobs, *c.logprobs], 0
        )

    def _completion_logprobs(
        self, token_ids: Sequence[int], logprobs: Logprobs, start: int
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

    def _chat_logprobs(self, token_ids: Sequence[int], logprobs: Logprobs) -> ChatChoiceLogprobs:
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


def error_body(error: BucketServeError) -> dict[str, Any]:
    """OpenAI's error object for a BucketServeError."""
    info = ErrorInfo(message=error.message, type=error.openai_type, code=error.http_status)
    return ErrorResponse(error=info).model_dump()


def error_event(error: BucketServeError) -> str:
    """The error as a stream event, once the response's headers are out."""
    return json.dumps({"error": error_body(error)["error"]})


def _finish_reason(reason: str | None, calls: bool = False) -> str:
    """OpenAI's name; a choice that ends in tool calls ends with "tool_calls"."""
    out = OPENAI_FINISH.get(reason or "", "stop")
    return "tool_calls" if calls and out == "stop" else out


def _delta_tool_call(call: ToolCall) -> DeltaToolCall:
    """A call's first delta has its id, type and name; later ones only arguments."""
    if not call.id:
        return DeltaToolCall(index=call.index, function=DeltaFunctionCall(arguments=call.arguments))
    function = DeltaFunctionCall(name=call.name, arguments=call.arguments)
    return DeltaToolCall(index=call.index, id=call.id, type="function", function=function)


def _padded(logprobs: Logprobs, n: int) -> list[TokenLogprob | None]:
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


def _final_usage(final: StreamDelta) -> UsageInfo:
    """The request's usage, with the prompt tokens found cached."""
    usage = _usage(final.num_prompt_tokens, final.num_output_tokens)
    usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=final.num_cached_tokens)
    return usage
