"""Tool calls read out of a model's text for `tool_choice="auto"`: each chat-template family
writes its calls its own way, so the reader is chosen by config (`model.tool_call_parser`).
Text that turns out not to be a call stays content; text that may still become one is held
back until it is decided."""

from __future__ import annotations

from bucketserve.gateway.tools.call_reader import (
    CallObject,
    CallReader,
    Event,
    held_prefix,
    skip,
)
from bucketserve.gateway.tools.json_scan import WHITESPACE


class HermesToolParser(CallReader):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around
    them (Hermes, Qwen 2.5 and 3, SmolLM3). A block whose object is no call is content."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._pos = 0  # text before this is out, as content or as a call
        self._call: CallObject | None = None

    def _read(self, final: bool) -> list[Event]:
        out: list[Event] = []
        text = self.text
        while True:
            call = self._call
            if call is None:
                at = text.find(self.OPEN, self._pos)
                end = at if at >= 0 else len(text)
                if at < 0 and not final:
                    end -= held_prefix(text, self._pos, self.OPEN)
                if end > self._pos:
                    out.append(text[self._pos : end])
                self._pos = end
                if at < 0:
                    return out
                call = self._call = CallObject(at + len(self.OPEN), self.calls)
            piece = call.advance(text)
            if piece is not None:
                out.append(piece)
            close = -1
            if call.finished:
                close = text.find(self.CLOSE, call.scanner.pos)
            if close < 0 and not final:
                return out
            end = len(text) if close < 0 else close + len(self.CLOSE)
            if call.started:
                self.calls += 1
            else:
                out.append(text[self._pos : end])
            self._pos, self._call = end, None


class Llama3JsonToolParser(CallReader):
    """A bare JSON object `{"name": ..., "parameters": {...}}` as the whole output (after an
    optional `<|python_tag|>`), or several joined by `;` (Llama 3.1 / 3.2 JSON tool
    calling). An output that does not start as such an object is content, as is the rest
    from an object that is no call."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    KEYS = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self._pos = 0
        self._state = "start"  # start, calls, content
        self._call: CallObject | None = None

    def _read(self, final: bool) -> list[Event]:
        text = self.text
        if self._state == "start":
            i = skip(text, 0, WHITESPACE)
            if text.startswith(self.TAG, i):
                i = skip(text, i + len(self.TAG), WHITESPACE)
            elif self.TAG.startswith(text[i:]) and not final:
                return []  # nothing yet, or maybe the tag
            if i == len(text) and not final:
                return []
            self._state = "calls" if text.startswith("{", i) else "content"
            self._pos = i if self._state == "calls" else 0
        out: list[Event] = []
        while self._state == "calls":
            call = self._call
            if call is None:
                i = skip(text, self._pos, WHITESPACE + ";")
                if i == len(text) and not final:
                    break
                if not text.startswith("{", i):
                    self._to_content(i if self.calls else 0)
                    break
                call = self._call = CallObject(i, self.calls, self.KEYS)
            piece = call.advance(text)
            if piece is not None:
                out.append(piece)
            if not call.finished and not final:
                break
            if not call.started or not call.scanner.done:
                if not call.started:
                    self._to_content(call.start if self.calls else 0)
                else:
                    self._state = "end"
                break
            self.calls += 1
            self._pos, self._call = call.scanner.pos, None
        if self._state == "content" and self._pos < len(text):
            out.append(text[self._pos :])
            self._pos = len(text)
        return out

    def _to_content(self, pos: int) -> None:
        self._state, self._pos, self._call = "content", pos, None


TOOL_PARSERS: dict[str, type[CallReader]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser)
}


def tool_parser(name: str | None) -> type[CallReader] | None:
    """The reader class `model.tool_call_parser` names (None: none configured)."""
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
