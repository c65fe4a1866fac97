"""Shape buckets from a file: one `(bs, query, blocks)` spec per line, never evaluated as Python.

Each of the three elements is an integer, a list `[a, b, ...]`, or
`range(a, b[, step])`, which (as in [Bucketing]) includes b when the
steps reach it: `range(256, 512, 128)` is 256, 384, 512. A line yields the
Cartesian product of its elements. Blank lines and `#` comments are skipped.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import NoReturn

ShapeBucket = tuple[int, int, int]

_TOKEN = re.compile(r"\s*(?:(?P<int>\d+)|(?P<name>[A-Za-z_]\w*)|(?P<punct>[()\[\],]))")


class BucketFileError(ValueError):
    pass


class BucketFileParser:
    """Parses one line at a time into its buckets; errors name the file, line and expectation."""

    def __init__(self, source: str = "<string>") -> None:
        self.source = source

    def parse_file(self, path: str | Path) -> list[ShapeBucket]:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise BucketFileError(f"cannot read bucket file {path}: {exc.strerror}") from exc
        self.source = str(path)
        return self.parse_text(text)

    def parse_text(self, text: str) -> list[ShapeBucket]:
        buckets: set[ShapeBucket] = set()
        for lineno, line in enumerate(text.splitlines(), start=1):
            spec = line.split("#", 1)[0].strip()
            if spec:
                buckets.update(self.parse_line(spec, lineno))
        if not buckets:
            raise BucketFileError(f"{self.source}: no bucket specs found")
        return sorted(buckets)

    def parse_line(self, line: str, lineno: int = 1) -> list[ShapeBucket]:
        self._tokens = self._tokenize(line, lineno)
        self._pos, self._lineno = 0, lineno
        self._expect("(", "'(' opening a (bs, query, blocks) tuple")
        dims = [self._element()]
        for _ in range(2):
            self._expect(",", "',' between the three tuple elements")
            dims.append(self._element())
        self._expect(")", "')' after exactly three elements (bs, query, blocks)")
        if self._pos != len(self._tokens):
            self._fail("end of line after the tuple")
        for name, values in (("bs", dims[0]), ("query", dims[1])):
            if min(values) < 1:
                self._fail(f"{name} values >= 1", str(min(values)))
        return [(b, q, n) for b, q, n in itertools.product(*dims)]

    def _tokenize(self, line: str, lineno: int) -> list[tuple[str, str, int]]:
        tokens, pos = [], 0
        while pos < len(line.rstrip()):
            match = _TOKEN.match(line, pos)
            if not match:
                column = len(line) - len(line[pos:].lstrip()) + 1
                raise BucketFileError(
                    f"{self.source}:{lineno}:{column}: unexpected character {line[column - 1]!r}; "
                    "expected integers, '[...]', 'range(...)', '(', ')' or ','"
                )
            kind = match.lastgroup or ""
            tokens.append((kind, match.group(kind), match.start(kind) + 1))
            pos = match.end()
        return tokens

    def _element(self) -> list[int]:
        kind, text, _ = self._peek()
        if kind == "int":
            self._pos += 1
            return [int(text)]
        if text == "[":
            return self._list()
        if text == "range":
            return self._range()
        self._fail("an integer, a list '[a, b, ...]' or 'range(a, b, step)'")

    def _list(self) -> list[int]:
        self._expect("[", "'['")
        values = [self._int("an integer in the list")]
        while self._peek()[1] == ",":
            self._pos += 1
            values.append(self._int("an integer after ',' in the list"))
        self._expect("]", "',' or ']' closing the list")
        return values

    def _range(self) -> list[int]:
        self._pos += 1
        self._expect("(", "'(' after range")
        args = [self._int("range start")]
        while self._peek()[1] == "," and len(args) < 3:
            self._pos += 1
            args.append(self._int("an integer range argument"))
        self._expect(")", "')' closing range(start, stop[, step])")
        if len(args) < 2:
            self._fail("range(start, stop[, step]) with at least two arguments", "range(...)")
        start, stop, step = (*args, 1) if len(args) == 2 else args
        if step < 1 or stop < start:
            self._fail("range with step >= 1 and stop >= start", f"range({start}, {stop}, {step})")
        return list(range(start, stop + 1, step))

    def _int(self, what: str) -> int:
        kind, text, _ = self._peek()
        if kind != "int":
            self._fail(what)
        self._pos += 1
        return int(text)

    def _expect(self, punct: str, what: str) -> None:
        if self._peek()[1] != punct:
            self._fail(what)
        self._pos += 1

    def _peek(self) -> tuple[str, str, int]:
        return self._tokens[self._pos] if self._pos < len(self._tokens) else ("end", "", 0)

    def _fail(self, expected: str, got: str | None = None) -> NoReturn:
        kind, text, column = self._peek()
        found = got if got is not None else (repr(text) if kind != "end" else "end of line")
        where = f"{self.source}:{self._lineno}" + (f":{column}" if column else "")
        raise BucketFileError(f"{where}: expected {expected}, got {found}")


def split_prompt_decode(buckets: list[ShapeBucket]) -> tuple[list[ShapeBucket], list[ShapeBucket]]:
    """Decode buckets have query length 1; every other bucket is a prompt bucket."""
    return [b for b in buckets if b[1] != 1], [b for b in buckets if b[1] == 1]
