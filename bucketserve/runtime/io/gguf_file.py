"""A GGUF file's metadata and tensor directory, parsed in one pass over a memory map.

The `gguf` package's reader builds a numpy view per element of every metadata array, which
takes seconds for a 150k-token vocabulary and tens of seconds for Gemma 3's 262k; this
reads the same values with `struct` and `numpy.frombuffer` (a fraction of a second).
Tensor data stays in the map: `GGUFTensor.data` is a view of its raw bytes (quantized
blocks as they are stored), which `gguf.quants` dequantizes where float weights are wanted.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# metadata value types: struct format of the scalars, and the two compound ones
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # row-major (the file lists dimensions innermost first)
    type: GGMLQuantizationType
    data: np.ndarray  # uint8: the stored bytes (quantized blocks, or the floats' bytes)

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape))


class GGUFFile:
    """`fields`: every metadata key with its value (arrays as lists); `tensors`: by name, in
    file order. Raises ValueError naming the file when it is not a GGUF this can read."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.path} is not a readable GGUF file: {e}") from e
        self._buf = memoryview(self._map)
        self._at = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, KeyError) as e:
            raise ValueError(f"{self.path} is not a readable GGUF file: {e!r}") from e

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != MAGIC:
            raise ValueError(f"{self.path} is not a readable GGUF file: no GGUF magic")
        self._at = 4
        version = self._scalar("I")
        if version not in (2, 3):
            what = "big-endian" if version > 0xFFFF else f"version {version}"
            raise ValueError(f"{self.path}: GGUF {what} is not supported (little-endian v2/v3)")
        tensor_count, kv_count = self._scalar("Q"), self._scalar("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar("I"))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = [self._scalar("Q") for _ in range(self._scalar("I"))]
            infos.append((name, tuple(reversed(dims)), self._scalar("I"), self._scalar("Q")))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._at // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, kind, offset in infos:
            qtype = GGMLQuantizationType(kind)
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape)) // block * type_size
            begin = start + offset
            if begin + nbytes > len(self._map):
                raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
            data = self._map[begin : begin + nbytes]
            self.tensors[name] = GGUFTensor(name, shape, qtype, data)

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self._buf, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("Q")
        text = bytes(self._buf[self._at : self._at + n]).decode("utf-8")
        self._at += n
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: unknown metadata value type {kind}")
        item, count = self._scalar("I"), self._scalar("Q")
        if item in _SCALARS and item != 7:
            dtype = np.dtype("<" + _SCALARS[item])
            values = np.frombuffer(self._buf, dtype, count, self._at)
            self._at += count * dtype.itemsize
            return values.tolist()
        return [self._value(item) for _ in range(count)]
