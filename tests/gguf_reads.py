"""One parse of a GGUF file's metadata where a test reads the same file several times.

gguf's reader builds every metadata array element by element: seconds for SmolLM2's ~150k
vocabulary entries, tens of seconds for Gemma 3's 262k tokens. transformers' GGUF loader
parses a file for the config, again for the weights and again for a tokenizer."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest


class _PlainMemmap:
    """numpy as gguf's reader sees it, except that `memmap` returns a plain ndarray view of
    the mapping: the same bytes, read lazily from the same file, but the reader's hundreds
    of thousands of small slices skip np.memmap's Python-level `__getitem__` and
    `__array_finalize__` (most of a parse's time: 25 s -> 10 s for Gemma 3's file)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def memmap(*args: Any, **kwargs: Any) -> np.ndarray:
        return np.memmap(*args, **kwargs).view(np.ndarray)


@contextlib.contextmanager
def one_parse_per_gguf(readers: dict[str, Any] | None = None) -> Iterator[None]:
    """Inside this block each GGUF file is parsed once and its reader (read-only: a memmap
    and the fields built from it) shared, also with other blocks given the same `readers`;
    so is transformers' metadata parse of it (`load_gguf_checkpoint` without tensors, which
    its config and tokenizer loaders each call), handed out as copies.
    For a reference's loads and for inputs whose parse is not what the test checks: a
    conversion under test parses its file for itself."""
    import gguf
    import gguf.gguf_reader
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    parse, hf_load = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    readers = {} if readers is None else readers

    def shared(path: str | os.PathLike[str], mode: str = "r") -> Any:
        if mode != "r":
            return parse(path, mode)
        key = os.path.realpath(path)
        if key not in readers:
            with pytest.MonkeyPatch.context() as plain:
                plain.setattr(gguf.gguf_reader, "np", _PlainMemmap())
                readers[key] = parse(path, mode)
        return readers[key]

    def metadata_once(path: str | os.PathLike[str], return_tensors: bool = False,
                      **kwargs: Any) -> Any:  # fmt: skip
        if return_tensors or kwargs:
            return hf_load(path, return_tensors, **kwargs)
        key = f"{os.path.realpath(path)} metadata"
        if key not in readers:
            readers[key] = hf_load(path, return_tensors)
        return copy.deepcopy(readers[key])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", shared)
        patch.setattr(hf_gguf, "load_gguf_checkpoint", metadata_once)
        yield
