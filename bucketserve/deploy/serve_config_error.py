"""A bad service config: which file, which key, what is allowed."""

from __future__ import annotations


class ServeConfigError(ValueError):
    """`path` is the YAML key path (`controller.prefill.num_workers`); `source` the file (or
    the flag) it came from, filled in by the loader."""

    def __init__(self, path: str, message: str, source: str | None = None) -> None:
        self.path, self.message, self.source = path, message, source
        super().__init__(self._text())

    def at(self, source: str) -> ServeConfigError:
        return ServeConfigError(self.path, self.message, source)

    def _text(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{self.source}: {where}{self.message}" if self.source else f"{where}{self.message}"
