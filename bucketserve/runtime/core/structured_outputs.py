"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some
strings or a grammar (torch-free; compiled by bucketserve.runtime.core.grammar_compiler)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output request, exactly one of:

    `json`: a JSON schema (a dict, or its JSON text); `json_object`: any JSON object;
    `regex`: the whole output matches it; `choice`: the output is one of these strings;
    `grammar`: a Lark grammar (llguidance's dialect) or a GBNF / EBNF one (`root ::= ...`).
    `disable_any_whitespace`: JSON output without free whitespace between its tokens;
    `whitespace_pattern`: a regex the whitespace between JSON tokens matches instead of any
    (vLLM's, and its `guided_whitespace_pattern`).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.validate()
        self._key: tuple[str, str, bool, str | None] | None = None

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if _given(getattr(self, k)))

    @property
    def spec(self) -> str:
        """The constraint's canonical text: a schema without its formatting (key order is
        kept, it orders the generated properties), the choices as a JSON list."""
        return self.key[1]

    @property
    def key(self) -> tuple[str, str, bool, str | None]:
        """(kind, canonical text, disable_any_whitespace, whitespace_pattern): equal keys
        compile to one grammar."""
        if self._key is None:
            kind = self.kind
            if kind == "json":
                value = json.loads(self.json) if isinstance(self.json, str) else self.json
                text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
            elif kind == "json_object":
                text = '{"type":"object"}'
            elif kind == "choice":
                text = json.dumps(self.choice, ensure_ascii=False)
            else:
                text = getattr(self, kind)
            self._key = (kind, text, bool(self.disable_any_whitespace), self.whitespace_pattern)
        return self._key

    def validate(self) -> None:
        """The shape only (one kind, the right types); ValueError naming the field. Whether
        the schema or grammar compiles is the compiler's question."""
        given = [k for k in KINDS if _given(getattr(self, k))]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}"
            )
        kind = given[0]
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    value = json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None
            else:
                value = self.json
            if not isinstance(value, dict):
                raise ValueError(
                    "structured_outputs.json must be a JSON schema (an object), got "
                    f"{type(value).__name__}"
                )
        elif kind == "json_object" and self.json_object is not True:
            raise ValueError(
                f"structured_outputs.json_object must be a bool, got {self.json_object!r}"
            )
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        elif kind == "choice" and (
            not isinstance(self.choice, list)
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ValueError(
                "structured_outputs.choice must be a non-empty list of non-empty strings"
            )
        pattern = self.whitespace_pattern
        if pattern is not None and (not isinstance(pattern, str) or not pattern):
            raise ValueError("structured_outputs.whitespace_pattern must be a non-empty regex")
        if pattern is not None and kind not in ("json", "json_object"):
            raise ValueError(
                f"structured_outputs.whitespace_pattern shapes JSON output; it cannot go with "
                f"{kind}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                "structured_outputs.disable_any_whitespace must be a bool, got "
                f"{self.disable_any_whitespace!r}"
            )


def _given(value: Any) -> bool:
    return value is not None and value is not False
