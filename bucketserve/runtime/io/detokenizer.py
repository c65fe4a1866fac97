"""Incremental detokenization with stop strings (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded along with the output, for leading-space rules


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer:
    """Turns one request's output tokens into text deltas, token by token.

    Text is emitted only once it is final: a token that ends inside a
    multi-byte UTF-8 character decodes to U+FFFD and waits for the tokens
    that complete it, and text that could be the start of a stop string is
    held back until it is known not to be. When a stop string appears, the
    text before it is emitted, the stop string never is, and `stop_reason`
    names it. `text` is everything emitted so far.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        self.stop_reason: str | None = None
        self.text = ""
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0  # start of the context re-decoded with each token
        self._read_offset = len(self._ids)  # ids before this are already turned into text
        self._held = ""  # decoded text not emitted yet: a possible stop-string start

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def push(self, token_id: int) -> str:
        """Add one output token; returns the text that became final (maybe "")."""
        if self.stopped:
            raise ValueError("detokenizer already hit a stop string; it takes no more tokens")
        self._ids.append(token_id)
        return self._emit(self._decode_new())

    def flush(self) -> str:
        """The request ended for another reason: release held text and any partial character."""
        if self.stopped:
            return ""
        tail = self._decode(self._ids[self._read_offset :]) if self._unread() else ""
        self._read_offset = len(self._ids)
        delta, self._held = self._held + tail, ""
        self.text += delta
        return delta

    def _unread(self) -> bool:
        return self._read_offset < len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self) -> str:
        """Text added by the ids after the read offset, once it ends on a whole character."""
        ids = self._ids
        prefix = self._decode(ids[self._prefix_offset : self._read_offset])
        full = self._decode(ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full[len(prefix) :]

    def _emit(self, new_text: str) -> str:
        if not new_text:
            return ""
        pending = self._held + new_text
        if self.stop:
            hit = self._find_stop(pending)
            if hit is not None:
                index, self.stop_reason = hit
                self._held = ""
                self.text += pending[:index]
                return pending[:index]
        keep = self._stop_prefix_len(pending)
        delta, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += delta
        return delta

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        best = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
