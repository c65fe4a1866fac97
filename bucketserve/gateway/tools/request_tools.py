"""`RequestTools`: a chat request's tools and what its tool_choice asks of the output (a
JSON schema for `required` and a named function, a parser for `auto`), read the same way
from an OpenAI body and a gRPC request."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from bucketserve.gateway.errors import InvalidArgumentError
from bucketserve.gateway.generate_input import GenerateInput
from bucketserve.gateway.sdk_types import ToolCall, merge_tool_calls
from bucketserve.gateway.tools.call_reader import ArrayCallReader, CallReader, NamedCallReader
from bucketserve.gateway.tools.tool_stream import ToolStream

ANY_OBJECT: dict[str, Any] = {"type": "object"}
MODES = ("none", "auto", "required")


@dataclass
class RequestTools:
    """`mode`: none (tools only rendered), auto (the text parsed), required (at least one
    call) or named (that function's arguments only)."""

    mode: str
    tools: list[dict[str, Any]]  # as the chat template takes them
    schemas: dict[str, dict[str, Any]]  # function name -> its parameters' schema
    named: str | None = None
    parallel: bool = True

    @classmethod
    def of(cls, inp: GenerateInput) -> RequestTools | None:
        """The input's tools (OpenAI's form: {"type": "function", "function": {...}}), None
        when it has none; InvalidArgumentError for a tool_choice they cannot meet."""
        if not inp.tools:
            if inp.tool_function is not None or inp.tool_choice == "required":
                raise InvalidArgumentError("tool_choice needs tools; send the functions in tools")
            return None
        schemas = {t["function"]["name"]: t["function"].get("parameters") or ANY_OBJECT
                   for t in inp.tools}
        choice = cls(mode="auto", tools=inp.tools, schemas=schemas,
                     parallel=inp.parallel_tool_calls is not False)
        if inp.tool_function is not None:
            name = inp.tool_function
            if name not in schemas:
                raise InvalidArgumentError(
                    f"tool_choice names the function {name!r}, but {name!r} is not among tools "
                    f"({sorted(schemas)})"
                )
            choice.mode, choice.named = "named", name
        elif inp.tool_choice is not None:
            if inp.tool_choice not in MODES:
                raise InvalidArgumentError(
                    f"tool_choice must be one of {list(MODES)} or name a function, got "
                    f"{inp.tool_choice!r}"
                )
            choice.mode = inp.tool_choice
        return choice

    @property
    def forced(self) -> bool:
        return self.mode in ("named", "required")

    def check_parser(self, parser: type[CallReader] | None) -> None:
        if self.mode == "auto" and parser is None:
            raise InvalidArgumentError(
                "tool_choice 'auto' (the default with tools) needs a tool call parser, and "
                "this server has none (model.tool_call_parser: hermes or llama3_json); ask for "
                "tool_choice 'required', 'none' or a named function"
            )

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

    def stream(self, parser: type[CallReader] | None) -> ToolStream | None:
        """A choice's reader of calls; None when its text is only content (tool_choice
        none, or auto with no parser)."""
        reader: CallReader
        if self.named is not None:
            reader = NamedCallReader(self.named)
        elif self.mode == "required":
            reader = ArrayCallReader()
        elif self.mode == "auto" and parser is not None:
            reader = parser()
        else:
            return None
        return ToolStream(reader, self.forced)

    def calls(
        self, text: str, parser: type[CallReader] | None
    ) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a choice's whole text, as its stream would have sent them;
        content None when the text is only calls. An output whose calls do not parse (cut
        short by max_tokens; a stream has sent their pieces by then) stays content."""
        stream = self.stream(parser)
        if stream is None:
            return text, []
        if self.forced:
            try:
                json.loads(text)
            except ValueError:
                return text, []
        content, pieces = stream.feed(text)
        rest, more = stream.finish()
        content += rest
        calls = merge_tool_calls(pieces + more)
        if (self.forced and not calls) or not all(_is_json(c.arguments) for c in calls):
            return text, []
        return (content if content or not calls else None), calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
