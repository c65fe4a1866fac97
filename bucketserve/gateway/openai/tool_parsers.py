"""Tool calls read out of a model's text, for `tool_choice="auto"`: each chat-template family
writes its calls its own way, so the parser is chosen by config (`model.tool_call_parser`).

A parser returns the text outside the calls and the calls as (name, arguments JSON text);
text that does not parse as a call stays content. For streaming, `held` says how much of
the text so far must wait, because it may turn out to start a call.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

Call = tuple[str, str]  # function name, arguments as JSON text


class ToolParser:
    name: ClassVar[str]

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls); content None when the text is only calls."""
        raise NotImplementedError

    def held(self, text: str) -> int:
        """How many characters at the end of `text` may be the start of a call."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around
    them (Hermes, Qwen 2.5 and 3, SmolLM3)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        calls: list[Call] = []
        kept: list[str] = []
        last = 0
        for match in self._CALL.finditer(text):
            call = _call(match.group(1), "arguments")
            if call is None:
                continue
            kept.append(text[last : match.start()])
            last = match.end()
            calls.append(call)
        kept.append(text[last:])
        return _content("".join(kept), calls), calls

    def held(self, text: str) -> int:
        at = text.find(self.OPEN)
        if at >= 0:
            return len(text) - at
        for n in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
            if self.OPEN.startswith(text[-n:]):
                return n
        return 0


class Llama3JsonToolParser(ToolParser):
    """A bare JSON object `{"name": ..., "parameters": {...}}` as the whole output, or
    several joined by `;` (Llama 3.1 / 3.2 JSON tool calling)."""

    name = "llama3_json"

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        at = 0
        while at < len(body):
            try:
                value, end = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = _named(value, "parameters") or _named(value, "arguments")
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return None, calls

    def held(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if body == "" or body.startswith(("{", "<|python_tag|>")) else 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser)
}


def tool_parser(name: str | None) -> ToolParser | None:
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


def _call(text: str, key: str) -> Call | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _named(value, key)


def _named(value: Any, key: str) -> Call | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        return value["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _content(text: str, calls: list[Call]) -> str | None:
    return None if calls and not text.strip() else text
