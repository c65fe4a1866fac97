"""One parse of a GGUF file's metadata where a test reads the same file several times.

gguf's reader builds every metadata array element by element: seconds for SmolLM2's ~150k
vocabulary entries, tens of seconds for Gemma 3's 262k tokens. transformers' GGUF loader
parses a file for the config, again for the weights and again for a tokenizer."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def one_parse_per_gguf(readers: dict[str, Any] | None = None) -> Iterator[None]:
    """Inside this block each GGUF file is parsed once and its reader (read-only: a memmap
    and the fields built from it) shared, also with other blocks given the same `readers`.
    For a reference's loads and for inputs whose parse is not what the test checks: a
    conversion under test parses its file for itself."""
    import gguf

    parse = gguf.GGUFReader
    readers = {} if readers is None else readers

    def shared(path: str | os.PathLike[str], mode: str = "r") -> Any:
        if mode != "r":
            return parse(path, mode)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", shared)
        yield
