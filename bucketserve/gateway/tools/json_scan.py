"""`ObjectScanner`: one JSON object's top-level members found while its text is still being
written, each with where its value starts and, once complete, ends, so a value can be
streamed as the model writes it (the text is read once, a character at a time at most)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
SCALAR_START = "-0123456789tfn"
_IN_STRING = re.compile(r'[^"\\]*')
_IN_NESTED = re.compile(r'[^"{}\[\]]*')


@dataclass
class Member:
    key: str
    start: int  # where its value's text begins
    end: int | None = None  # just past the value, once complete


class ObjectScanner:
    """Reads a text from `start`, where an object's `{` is due (after whitespace). `scan` may
    be called again as the text grows and resumes where it stopped. `done`: the object
    closed at `end`; `failed`: the text stopped being an object at `pos`. Nested values are
    only balanced, not checked: their owner parses them once complete."""

    def __init__(self, start: int) -> None:
        self.pos = start
        self.members: dict[str, Member] = {}  # the first of duplicate keys
        self.done = False
        self.failed = False
        self.end: int | None = None
        self._state = "open"
        self._key_start = 0
        self._key = ""
        self._member: Member | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False

    @property
    def finished(self) -> bool:
        return self.done or self.failed

    def scan(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and not self.finished:
            i = self._step(text, i)
        self.pos = i

    def _step(self, text: str, i: int) -> int:
        state = self._state
        if self._escape:
            self._escape = False
            return i + 1
        if state in ("key_string", "string") or self._in_string:
            return self._string(text, i)
        c = text[i]
        if state == "nested":
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return self._value_end(i + 1)
            else:
                return _IN_NESTED.match(text, i).end()  # type: ignore[union-attr]
            return i + 1
        if state == "scalar":
            if c in WHITESPACE or c in ",}]":
                return self._value_end(i)
            return i + 1
        if c in WHITESPACE:
            return i + 1
        if state == "open" and c == "{":
            self._state = "key"
            return i + 1
        if state == "key" and c == '"':
            self._key_start, self._state = i, "key_string"
            return i + 1
        if state == "key" and c == "}" and not self.members:
            return self._close(i)
        if state == "colon" and c == ":":
            self._state = "value"
            return i + 1
        if state == "value" and (c in '{["' or c in SCALAR_START):
            self._member = Member(self._key, i)
            self.members.setdefault(self._key, self._member)
            self._state = "nested" if c in "{[" else "string" if c == '"' else "scalar"
            self._depth = 1
            return i + 1
        if state == "after" and c == ",":
            self._state = "key"
            return i + 1
        if state == "after" and c == "}":
            return self._close(i)
        self.failed = True
        return i

    def _string(self, text: str, i: int) -> int:
        """Inside a string: up to its next quote or backslash."""
        j = _IN_STRING.match(text, i).end()  # type: ignore[union-attr]
        if j == len(text):
            return j
        if text[j] == "\\":
            self._escape = True
            return j + 1
        if self._in_string:
            self._in_string = False
        elif self._state == "string":
            return self._value_end(j + 1)
        else:
            try:
                self._key = json.loads(text[self._key_start : j + 1])
            except ValueError:
                self.failed = True
                return j
            self._state = "colon"
        return j + 1

    def _value_end(self, end: int) -> int:
        assert self._member is not None
        self._member.end = end
        self._state = "after"
        return end

    def _close(self, i: int) -> int:
        self.done, self.end = True, i + 1
        return i + 1
