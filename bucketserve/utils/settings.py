"""The base of every model a config file is read into: unknown keys and wrong types are errors,
and an error names the key path (`controller.decode.num_workers`) and what is allowed there.

A field's docstring is its description in the generated key reference
(`docs/configuration.md`). A field declared with `exclude=True` is set by the code that
builds the config, not by the file: the file may not name it and the reference omits it.
A field with an alias is that key in the file and its name in code.
A validator that checks several keys of one section raises
`SettingsError(key, message)` to pin the error on that key.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from typing import Any, Literal, Self, Union

import annotated_types
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator
from pydantic.fields import FieldInfo


class SettingsError(ValueError):
    """`path`: the key path the value came from; `message`: what is wrong and what is allowed."""

    def __init__(self, path: str, message: str) -> None:
        self.path, self.message = path, message
        super().__init__(f"{path}: {message}" if path else message)


class Settings(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        use_attribute_docstrings=True,
        validate_by_name=True,  # code passes field names; files give the aliases
        validate_by_alias=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _absent_sections(cls, data: Any) -> Any:
        """A section written with nothing under it (`controller:`) is a section left out."""
        if not isinstance(data, dict):
            return data
        sections = {
            f.alias or name for name, f in cls.model_fields.items() if _model(f.annotation)
        }
        return {k: v for k, v in data.items() if v is not None or k not in sections}

    @model_validator(mode="before")
    @classmethod
    def _no_code_keys_in_files(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict) or not (info.context or {}).get("file"):
            return data
        for key in data:
            field = cls.model_fields.get(key) or _field(cls, key)
            if field is not None and (field.exclude or field.alias not in (None, key)):
                raise SettingsError(key, _unknown_key_text(key, file_keys(cls), None))
        return data

    @classmethod
    def parse(cls, data: Any, where: str = "", file: bool = True) -> Self:
        """`data` (read from a file, unless `file` is false: then the code's keys are
        allowed too) validated; SettingsError for its first bad key, its path under
        `where`."""
        try:
            return cls.model_validate({} if data is None else data, context={"file": file})
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            path, message = explain(cls, data, error, where)
            raise SettingsError(path, message) from None


# -- one pydantic error, in the config's words ----------------------------------------------------


def explain(model: type[BaseModel], data: Any, error: Any, where: str = "") -> tuple[str, str]:
    """(key path under `where`, message) of one pydantic error of `model.model_validate(data)`."""
    loc, kind = tuple(error["loc"]), error["type"]

    def _render(part: tuple[Any, ...]) -> str:
        return _join(where, _path(part))

    if kind == "extra_forbidden":
        return _render(loc), _unknown_key(model, loc, _render(loc[:-1]))
    if kind == "missing":
        return _render(loc[:-1]), f"{loc[-1]} is required"
    if kind in ("value_error", "assertion_error"):
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, SettingsError):
            return _join(_render(loc), cause.path), cause.message
        return _render(loc), str(cause) if cause is not None else error["msg"]
    keys, key_hint, hint = _locate(model, loc)
    value = error.get("input")
    inside = keys < len(loc) and _model(_plain(hint)) is None
    if inside and (kind.endswith(("_type", "_parsing")) or _is_union(key_hint)):
        # a wrong type in a list, a mapping or a union: say what the key takes
        whole = _value_at(data, loc[:keys])
        return _render(loc[:keys]), f"must be {describe(key_hint)}, got {_kind(whole)}"
    if kind == "literal_error" or kind.startswith(("greater_", "less_")):
        return _render(loc), f"must be {describe(hint)}, got {value!r}"
    if kind.endswith(("_type", "_parsing")) or kind == "none_required":
        return _render(loc), f"must be {describe(hint)}, got {_kind(value)}"
    if kind == "string_too_short":
        return _render(loc), f"must be a non-empty string, got {value!r}"
    return _render(loc), error["msg"]


def _locate(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[int, Any, Any]:
    """How far `loc` names keys (fields, or items that are mappings of keys), the type there,
    and the type at the end of `loc` as far as it resolves (a list item, a mapping value)."""
    hint: Any = model
    keys, key_hint = 0, hint
    for depth, part in enumerate(loc, 1):
        inner = _plain(hint)
        sub = _model(inner)
        if sub is not None and isinstance(part, str) and _field(sub, part) is not None:
            hint = _annotated(_field(sub, part))
        elif isinstance(part, int) and typing.get_origin(inner) in (list, tuple):
            hint = typing.get_args(inner)[0]
        elif isinstance(part, str) and typing.get_origin(inner) is dict:
            hint = typing.get_args(inner)[1]
        else:
            break
        if sub is not None or _model(hint) is not None:
            keys, key_hint = depth, hint
    return keys, key_hint, hint


def _is_union(hint: Any) -> bool:
    return typing.get_origin(_plain(hint)) in (Union, types.UnionType)


def _field(model: type[BaseModel], key: str) -> FieldInfo | None:
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return field
    return None


def _annotated(field: FieldInfo) -> Any:
    if not field.metadata:
        return field.annotation
    return typing.Annotated[(field.annotation, *field.metadata)]


def _unknown_key(model: type[BaseModel], loc: tuple[Any, ...], parent_path: str) -> str:
    _, _, hint = _locate(model, loc[:-1])
    return _unknown_key_text(str(loc[-1]), file_keys(_model(hint) or model), parent_path)


def _unknown_key_text(key: str, allowed: list[str], parent_path: str | None) -> str:
    """`parent_path` "": the top level; None: said by the error's path."""
    close = difflib.get_close_matches(key, allowed, n=1)
    hint_text = f" (did you mean {close[0]!r}?)" if close else ""
    where = "" if parent_path is None else f" under {parent_path}" if parent_path else (
        " at the top level")
    return f"unknown key {key!r}{hint_text}; allowed{where}: {allowed}"


def file_keys(model: type[BaseModel]) -> list[str]:
    """The keys a config file may give `model`: its fields but those the code sets."""
    return sorted(f.alias or name for name, f in model.model_fields.items() if not f.exclude)


# -- types in words -------------------------------------------------------------------------------


def describe(hint: Any) -> str:
    """What a value of this type is, for a sentence: "an integer >= 1 or null"."""
    base, metadata = _strip(hint)
    origin = typing.get_origin(base)
    if origin in (Union, types.UnionType):
        args = typing.get_args(base)
        parts = [describe(_with(a, metadata)) for a in args if a is not type(None)]
        text = _or(parts)
        return f"{text} or null" if type(None) in args else text
    if origin is Literal:
        values = [_literal(v) for v in typing.get_args(base)]
        return f"one of {', '.join(values)}" if len(values) > 1 else values[0]
    if origin is dict:
        return f"a mapping of names to {_plural(describe(typing.get_args(base)[1]))}"
    if origin in (list, tuple):
        return f"a list of {_plural(describe(typing.get_args(base)[0]))}"
    if _model(base) is not None:
        return "a mapping"
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a number",
             str: "a string", Any: "anything"}
    text = names.get(base, getattr(base, "__name__", str(base)))
    bounds = bounds_text(hint)
    return f"{text} {bounds}" if bounds else text


def bounds_text(hint: Any) -> str:
    """The range a numeric type allows, as "> 0", "in (0, 1]" or "" (none)."""
    _, metadata = _strip(hint)
    low = high = None
    for item in metadata:
        for bound in getattr(item, "metadata", None) or [item]:
            if isinstance(bound, (annotated_types.Gt, annotated_types.Ge)):
                low = bound
            elif isinstance(bound, (annotated_types.Lt, annotated_types.Le)):
                high = bound
    lo = getattr(low, "gt", None) if isinstance(low, annotated_types.Gt) else getattr(
        low, "ge", None)
    hi = getattr(high, "lt", None) if isinstance(high, annotated_types.Lt) else getattr(
        high, "le", None)
    if low is not None and high is not None:
        left = "(" if isinstance(low, annotated_types.Gt) else "["
        right = ")" if isinstance(high, annotated_types.Lt) else "]"
        return f"in {left}{_num(lo)}, {_num(hi)}{right}"
    if low is not None:
        return f"{'>' if isinstance(low, annotated_types.Gt) else '>='} {_num(lo)}"
    if high is not None:
        return f"{'<' if isinstance(high, annotated_types.Lt) else '<='} {_num(hi)}"
    return ""


def _strip(hint: Any) -> tuple[Any, list[Any]]:
    metadata: list[Any] = []
    while typing.get_origin(hint) is typing.Annotated:
        hint, *more = typing.get_args(hint)
        metadata += more
    return hint, metadata


def _with(hint: Any, metadata: list[Any]) -> Any:
    return typing.Annotated[(hint, *metadata)] if metadata else hint


def _plain(hint: Any) -> Any:
    """`hint` without Annotated and without `| None`."""
    while typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _plain(args[0])
    return hint


def _model(hint: Any) -> type[BaseModel] | None:
    hint = _plain(hint)
    return hint if isinstance(hint, type) and issubclass(hint, BaseModel) else None


def _or(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} or {parts[-1]}"


def _plural(text: str) -> str:
    for article in ("an ", "a "):
        if text.startswith(article):
            noun, _, rest = text[len(article):].partition(" ")
            return f"{noun}s {rest}".strip()
    return text


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)


def _num(value: Any) -> str:
    if isinstance(value, float) and not math.isinf(value) and value == int(value):
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


_KINDS = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number",
          str: "a string", list: "a list", dict: "a mapping"}


def _kind(value: Any) -> str:
    kind = _KINDS.get(type(value), type(value).__name__)
    return kind if value is None else f"{kind} {value!r}"


# -- key paths ------------------------------------------------------------------------------------


def _path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def _join(where: str, path: str) -> str:
    if not where or not path:
        return where or path
    return f"{where}{path}" if path.startswith("[") else f"{where}.{path}"


def _value_at(data: Any, loc: tuple[Any, ...]) -> Any:
    for part in loc:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data
