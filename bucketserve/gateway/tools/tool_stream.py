"""`ToolStream`: one choice's text split into content and tool-call deltas as it comes."""

from __future__ import annotations

import uuid

from bucketserve.gateway.sdk_types import ToolCall
from bucketserve.gateway.tools.call_reader import CallPiece, CallReader, Event


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolStream:
    """Content goes out once the reader is sure it is no call and, until some of it is not
    whitespace, waits (a choice that is only calls has no content). A forced choice (tool
    choice required or named) has none, unless nothing in it became a call. Each call's
    first delta has its id and name; later ones carry pieces of its arguments."""

    def __init__(self, reader: CallReader, forced: bool) -> None:
        self.reader = reader
        self.forced = forced
        self.content = ""
        self.sent = 0  # characters of `content` sent
        self.ids: dict[int, str] = {}

    @property
    def called(self) -> bool:
        """Whether the choice made a call (its finish reason is then tool_calls)."""
        return bool(self.ids)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, deltas) that can be sent now."""
        return self._out(self.reader.feed(text) if text else [], final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest once the choice has ended."""
        return self._out(self.reader.finish(), final=True)

    def _out(self, events: list[Event], final: bool) -> tuple[str, list[ToolCall]]:
        deltas = []
        for event in events:
            if isinstance(event, CallPiece):
                deltas.append(self._delta(event))
            else:
                self.content += event
        if self.forced:
            return (self.reader.text if final and not self.ids else ""), deltas
        if not self.content.strip() and (not final or self.ids):
            return "", deltas
        ready = self.content[self.sent :]
        self.sent += len(ready)
        return ready, deltas

    def _delta(self, piece: CallPiece) -> ToolCall:
        if piece.name is None:
            return ToolCall(piece.index, arguments=piece.arguments)
        self.ids[piece.index] = call_id()
        return ToolCall(piece.index, self.ids[piece.index], piece.name, piece.arguments)
