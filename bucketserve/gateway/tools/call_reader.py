"""Readers of tool calls in one choice's text as it grows. A reader takes the text in
pieces and returns, in order, what became certain: content (str) and `CallPiece`s. A call's
arguments go out as the model writes them, exactly as written (the raw JSON text of the
value), so the pieces add up to the same string whether the text came at once or a token at
a time. `NamedCallReader` and `ArrayCallReader` read the output that tool_choice named and
required constrain; `tool_parsers` holds the readers of each chat template's own format."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from bucketserve.gateway.tools.json_scan import WHITESPACE, ObjectScanner


@dataclass
class CallPiece:
    index: int  # the call's place among the choice's calls
    name: str | None  # on the call's first piece only
    arguments: str  # the next part of its arguments' JSON text


Event = str | CallPiece


class CallReader:
    """`feed(text)`: the text that came since; `finish()`: the text is complete, and
    what was held back (a call cut short that never started is content) comes out."""

    def __init__(self) -> None:
        self.text = ""
        self.calls = 0  # calls started so far

    def feed(self, text: str) -> list[Event]:
        self.text += text
        return self._read(final=False)

    def finish(self) -> list[Event]:
        return self._read(final=True)

    def _read(self, final: bool) -> list[Event]:
        raise NotImplementedError


class CallObject:
    """One call written as a JSON object: its function under "name" and its arguments under
    the first of `keys` present: an object (sent as it is written), a string holding the
    arguments' JSON text (sent once complete) or nothing ("{}" once the object closes).
    Anything else, or a name that is not a string, makes it no call (`rejected`), decided
    before its first piece."""

    def __init__(self, start: int, index: int, keys: Sequence[str] = ("arguments",)) -> None:
        self.scanner = ObjectScanner(start)
        self.start = start
        self.index = index
        self.keys = keys
        self.name: str | None = None
        self.started = False
        self.rejected = False
        self._sent = 0  # characters of the arguments' text sent

    @property
    def finished(self) -> bool:
        return self.rejected or self.scanner.finished

    def advance(self, text: str) -> CallPiece | None:
        """The call's next piece once `text` is scanned, if there is one."""
        scanner = self.scanner
        scanner.scan(text)
        if self.rejected:
            return None
        if self.name is None:
            self.name = self._name(text)
            if self.name is None:
                self.rejected = self.rejected or scanner.finished
                return None
        args = next((scanner.members[k] for k in self.keys if k in scanner.members), None)
        if args is None:
            if scanner.done and not self.started:
                return self._piece("{}")
            self.rejected = scanner.failed and not self.started
            return None
        first = text[args.start]
        if first == "{":
            end = args.end if args.end is not None else scanner.pos
            new = text[args.start + self._sent : end]
            self._sent += len(new)
            return self._piece(new) if new or not self.started else None
        if self.started:
            return None
        if first == '"' and args.end is not None:
            try:
                value = json.loads(text[args.start : args.end])
            except ValueError:
                value = None
            if isinstance(value, str):
                return self._piece(value)
            self.rejected = True
        elif first != '"' or scanner.failed:
            self.rejected = True
        return None

    def _name(self, text: str) -> str | None:
        member = self.scanner.members.get("name")
        if member is None or member.end is None:
            return None
        try:
            name = json.loads(text[member.start : member.end])
        except ValueError:
            name = None
        if not isinstance(name, str):
            self.rejected = True
            return None
        return name

    def _piece(self, arguments: str) -> CallPiece:
        piece = CallPiece(self.index, None if self.started else self.name, arguments)
        self.started = True
        return piece


class NamedCallReader(CallReader):
    """tool_choice names a function: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._sent = 0

    def _read(self, final: bool) -> list[Event]:
        new = self.text[self._sent :]
        if not new:
            return []
        self._sent = len(self.text)
        first = self.calls == 0
        self.calls = 1
        return [CallPiece(0, self.name if first else None, new)]


class ArrayCallReader(CallReader):
    """tool_choice required: the output is a JSON array of {"name", "arguments"} objects.
    Reading stops at the first element that is no call."""

    def __init__(self) -> None:
        super().__init__()
        self._pos = 0
        self._state = "open"  # open, element, between, end
        self._call: CallObject | None = None

    def _read(self, final: bool) -> list[Event]:
        out: list[Event] = []
        text = self.text
        while self._state != "end":
            if self._call is not None:
                piece = self._call.advance(text)
                if piece is not None:
                    out.append(piece)
                if not self._call.finished:
                    break
                self._state = "between" if self._call.started and self._call.scanner.done else "end"
                self.calls += self._call.started
                self._pos = self._call.scanner.pos
                self._call = None
                continue
            i = skip(text, self._pos, WHITESPACE)
            if i == len(text):
                self._pos = i
                break
            c, self._pos = text[i], i + 1
            if (self._state, c) in (("open", "["), ("between", ",")):
                self._state = "element"
            elif self._state == "element" and c == "{":
                self._call = CallObject(i, self.calls)
            else:
                self._state = "end"
        return out


def skip(text: str, i: int, chars: str) -> int:
    """The first index from `i` whose character is not among `chars`."""
    n = len(text)
    while i < n and text[i] in chars:
        i += 1
    return i


def held_prefix(text: str, start: int, tag: str) -> int:
    """How many characters at the end of text[start:] may begin `tag`."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
