"""OpenAI tools on a chat request: what `tool_choice` asks of the output (a JSON schema for
`required` and a named function, a parser for `auto`), and a choice's text turned into
`tool_calls`, whole or as stream deltas that add up to the same calls."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from bucketserve.gateway.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    NamedToolChoice,
    ToolCallOut,
)
from bucketserve.gateway.openai.tool_parsers import Call, ToolParser

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolChoice:
    """`mode`: none (tools only rendered), auto (the text parsed), required (at least one
    call) or named (that function's arguments only)."""

    mode: str
    tools: list[dict[str, Any]]  # as the chat template takes them
    schemas: dict[str, dict[str, Any]]  # function name -> its parameters' schema
    named: str | None = None
    parallel: bool = True

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> ToolChoice | None:
        """None when the request carries no tools."""
        if not req.tools:
            if isinstance(req.tool_choice, NamedToolChoice) or req.tool_choice == "required":
                raise ValueError("tool_choice needs tools; send the functions in tools")
            return None
        schemas = {t.function.name: t.function.parameters or ANY_OBJECT for t in req.tools}
        choice = cls(
            mode="auto",
            tools=[t.model_dump(exclude_none=True, by_alias=True) for t in req.tools],
            schemas=schemas,
            parallel=req.parallel_tool_calls is not False,
        )
        if isinstance(req.tool_choice, NamedToolChoice):
            name = req.tool_choice.function.name
            if name not in schemas:
                raise ValueError(
                    f"tool_choice.function.name {name!r} is not among tools ({sorted(schemas)})"
                )
            choice.mode, choice.named = "named", name
        elif req.tool_choice is not None:
            choice.mode = req.tool_choice
        return choice

    @property
    def forced(self) -> bool:
        return self.mode in ("named", "required")

    def schema(self) -> dict[str, Any]:
        """What a forced choice's output must be: the named function's arguments, or a list
        of {"name", "arguments"} calls (one unless parallel_tool_calls)."""
        if self.named is not None:
            return self.schemas[self.named]
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": schema},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, schema in self.schemas.items()
        ]
        items = calls[0] if len(calls) == 1 else {"anyOf": calls}
        out: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if not self.parallel:
            out["maxItems"] = 1
        return out

    def calls(self, text: str, parser: ToolParser | None) -> tuple[str | None, list[Call]]:
        """(content, calls) of a choice's whole text; a forced output that does not parse
        (cut short by max_tokens) stays content."""
        if self.named is not None:
            try:
                json.loads(text)
            except ValueError:
                return text, []
            return None, [(self.named, text)]
        if self.mode == "required":
            try:
                value = json.loads(text)
            except ValueError:
                return text, []
            if not isinstance(value, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c
                for c in value
            ):
                return text, []
            return None, [
                (c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value
            ]
        if self.mode == "auto" and parser is not None:
            content, calls = parser.extract(text)
            return content, calls
        return text, []


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_out(calls: list[Call]) -> list[ToolCallOut]:
    return [
        ToolCallOut.model_validate(
            {"id": call_id(), "function": {"name": name, "arguments": arguments}}
        )
        for name, arguments in calls
    ]


@dataclass
class ToolStream:
    """One streamed choice: its text is held back while it may be a call (all of it when
    the choice is forced), and the calls go out as deltas once the choice ends."""

    choice: ToolChoice
    parser: ToolParser | None
    text: str = ""
    sent: int = 0  # characters of `text` already sent as content

    def feed(self, text: str) -> str:
        """The content that can be sent now."""
        self.text += text
        if self.choice.forced:
            return ""
        held = self.parser.held(self.text) if self.parser is not None else 0
        ready = self.text[self.sent : len(self.text) - held]
        self.sent += len(ready)
        return ready

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """The rest of the content, and the calls as deltas: per call its id and name, then
        its arguments."""
        content, calls = self.choice.calls(self.text, self.parser)
        sent = self.text[: self.sent]
        rest = content[len(sent) :] if content and content.startswith(sent) else ""
        deltas = []
        for i, (name, arguments) in enumerate(calls):
            deltas.append(
                DeltaToolCall(
                    index=i,
                    id=call_id(),
                    type="function",
                    function=DeltaFunctionCall(name=name, arguments=""),
                )
            )
            deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=arguments)))
        return rest, deltas
