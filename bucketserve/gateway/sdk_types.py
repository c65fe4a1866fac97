"""What the SDK takes and returns (torch-free): tools and tool_choice, stream chunks, tool
calls and the whole completion."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from bucketserve.messages import RequestTimings
from bucketserve.runtime.core.logprobs import TokenLogprob


@dataclass(frozen=True)
class Tool:
    """A function the model may call (OpenAI's `tools[].function`). `parameters`: its
    arguments' JSON schema, as a dict or JSON text (None: any object)."""

    name: str
    parameters: dict[str, Any] | str | None = None
    description: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's form, which chat templates take as `tools`."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """What the model does with the tools: `mode` none (they are only shown to it), auto
    (it decides; calls are read out of its text with the server's model.tool_call_parser)
    or required (at least one call, constrained to the tools' schemas); or `function`:
    exactly one call of that function (`ToolChoice.named("f")`)."""

    mode: Literal["none", "auto", "required"] = "auto"
    function: str | None = None

    @classmethod
    def named(cls, function: str) -> ToolChoice:
        return cls(function=function)


@dataclass
class ToolCall:
    """A call the model made. In a Chunk, a piece of one: its first piece has `id` and
    `name`, and the `arguments` of a call's pieces concatenate to its arguments' JSON text;
    in a Sample or Completion, whole."""

    index: int  # its place among the sample's calls
    id: str = ""
    name: str = ""
    arguments: str = ""

    def parsed(self) -> Any:
        """The arguments as a Python value."""
        return json.loads(self.arguments)


def merge_tool_calls(pieces: Iterable[ToolCall]) -> list[ToolCall]:
    """Whole calls, in index order, from their pieces."""
    calls: dict[int, ToolCall] = {}
    for piece in pieces:
        call = calls.get(piece.index)
        if call is None:
            calls[piece.index] = ToolCall(piece.index, piece.id, piece.name, piece.arguments)
            continue
        call.id = call.id or piece.id
        call.name = call.name or piece.name
        call.arguments += piece.arguments
    return [calls[i] for i in sorted(calls)]


@dataclass
class Chunk:
    """New tokens of one request's sample `index`; the last chunk has `finished=True` and
    the final fields. With n > 1 samples, each sample's last chunk has its `finish_reason`."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # stop / length / cancelled / error / tool_calls
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: RequestTimings | None = None
    request_bucket: tuple[int, int] | None = None  # [low, up) prompt lengths
    shape_bucket: tuple[int, int, int] | None = None  # (batch, query, blocks)
    # one per token when the request asked for logprobs (None: not known)
    logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # the sample of an n > 1 request
    # once, when the request asked for prompt_logprobs: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0  # of prompt_tokens, those found in a prefix cache (final chunk)
    # pieces of the sample's tool calls (a request with tools); `text` is then the content
    # outside them
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Sample:
    """One of a request's n samples, whole."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None  # stop / length / cancelled / error / tool_calls
    tool_calls: list[ToolCall] = field(default_factory=list)  # whole


@dataclass
class Completion(Chunk):
    """A whole request: every token, all the text and the tool calls of sample 0, with the
    final chunk's fields; `choices` holds every sample (n of them)."""

    choices: list[Sample] = field(default_factory=list)

    @classmethod
    def from_chunks(cls, chunks: Iterable[Chunk]) -> Completion:
        samples: dict[int, Sample] = {}
        prompt_logprobs = None
        final: Chunk | None = None
        for chunk in chunks:
            sample = samples.setdefault(chunk.index, Sample(chunk.index))
            sample.token_ids.extend(chunk.token_ids)
            sample.text += chunk.text
            if chunk.logprobs is not None:
                sample.logprobs = (sample.logprobs or []) + list(chunk.logprobs)
            if chunk.finish_reason is not None:
                sample.finish_reason = chunk.finish_reason
            sample.tool_calls.extend(chunk.tool_calls)
            if chunk.prompt_logprobs is not None:
                prompt_logprobs = chunk.prompt_logprobs
            if chunk.finished:
                final = chunk
        if final is None:
            raise ValueError("the stream ended without a final chunk")
        choices = [samples[i] for i in sorted(samples)]
        for sample in choices:
            sample.tool_calls = merge_tool_calls(sample.tool_calls)
        first = samples.get(0, Sample(0))
        return cls(
            **{
                **final.__dict__,
                "token_ids": first.token_ids,
                "text": first.text,
                "logprobs": first.logprobs,
                "index": 0,
                "prompt_logprobs": prompt_logprobs,
                "tool_calls": first.tool_calls,
            },
            choices=choices,
        )


@dataclass(frozen=True)
class ModelInfo:
    model: str
    max_model_len: int
    block_size: int
    vocab_size: int
    tenant: str  # the tenant the client's key belongs to
