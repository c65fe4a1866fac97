"""An HTTP request body read into its protocol model. A body over
gateway.max_message_bytes (413) or not UTF-8 (400) is refused before any parsing work, a
list or text over its request limit before its elements are validated; a ValidationError
becomes one InvalidArgumentError that names the field and says what to send instead."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from bucketserve.gateway.errors import InvalidArgumentError, PayloadTooLargeError
from bucketserve.gateway.request_limits import RequestLimits

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

_KINDS = {
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "missing": "is required",
}
_BOUNDS = {
    "greater_than_equal": ("ge", ">="),
    "greater_than": ("gt", ">"),
    "less_than_equal": ("le", "<="),
    "less_than": ("lt", "<"),
}
MAX_SHOWN = 3  # errors named in one message
MAX_INPUT_REPR = 60


class BodyRefused(Exception):  # not a ValueError, which pydantic would wrap
    """Raised by a validator to end the parse at once with `error` (a request limit)."""

    def __init__(self, error: InvalidArgumentError) -> None:
        super().__init__(error.message)
        self.error = error


async def read_text(request: web.Request, limit: int) -> str:
    """The body as text, at most `limit` bytes."""
    length = request.content_length
    if length is not None and length > limit:
        raise _too_large(length, limit)
    try:
        raw = await request.read()  # aiohttp stops reading past client_max_size
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(None, limit) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(
            f"the request body is not valid UTF-8 (byte {exc.start} is {raw[exc.start]:#04x}); "
            "send JSON encoded as UTF-8"
        ) from None


def parse_body(
    model: type[M], body: str | bytes | Any, limits: RequestLimits | None = None
) -> M:
    """`body` (JSON text, or already decoded) as `model`, its lists and texts within
    `limits` (the defaults if None); keys it does not know are logged at debug level and
    ignored."""
    context = {"limits": limits or RequestLimits()}
    try:
        if isinstance(body, (str, bytes)):
            parsed = model.model_validate_json(body, context=context)
        else:
            parsed = model.model_validate(body, context=context)
    except ValidationError as exc:
        raise _invalid(exc) from None
    except BodyRefused as exc:
        raise exc.error from None
    unknown = _unknown_fields(parsed)
    if unknown:
        logger.debug("%s: ignoring unknown fields %s", model.__name__, unknown)
    return parsed


def _unknown_fields(value: Any, path: str = "") -> list[str]:
    """The keys of `value` (and the models inside it) that no field declares."""
    if isinstance(value, list):
        if not value or not isinstance(value[0], BaseModel):  # a list of models or of none
            return []
        return [u for i, v in enumerate(value) for u in _unknown_fields(v, f"{path}[{i}]")]
    if not isinstance(value, BaseModel):
        return []
    prefix = f"{path}." if path else ""
    found = [f"{prefix}{key}" for key in value.model_extra or {}]
    for name in type(value).model_fields:
        found += _unknown_fields(getattr(value, name), f"{prefix}{name}")
    return found


def _invalid(exc: ValidationError) -> InvalidArgumentError:
    errors = exc.errors(include_url=False)
    for error in errors:
        if error["type"] == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", error["msg"])
            return InvalidArgumentError(f"the request body is not valid JSON: {detail}")
        if not error["loc"]:
            return InvalidArgumentError("the request body must be a JSON object")
    return InvalidArgumentError("; ".join(_describe(e) for e in errors[:MAX_SHOWN]))


def _describe(error: dict[str, Any]) -> str:
    where = _field_path(error["loc"])
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "value_error":
        return f"{where} {ctx.get('error', error['msg'])}"
    if kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        return f"{where} must be {op} {ctx[key]}, got {_shown(error['input'])}"
    if kind == "too_short":
        return f"{where} must have at least {ctx.get('min_length')} item(s)"
    if kind == "literal_error":
        return f"{where} must be {ctx.get('expected')}, got {_shown(error['input'])}"
    if kind == "missing":
        return f"{where} is required"
    phrase = _KINDS.get(kind, error["msg"].lower())
    return f"{where} {phrase}, got {_shown(error['input'])}"


def _field_path(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_INPUT_REPR else f"{text[:MAX_INPUT_REPR]}..."


def _too_large(length: int | None, limit: int) -> PayloadTooLargeError:
    size = "more" if length is None else f"{length} bytes, more"
    return PayloadTooLargeError(
        f"the request body is {size} than this server's limit of {limit} bytes "
        "(gateway.max_message_bytes); send a shorter prompt"
    )
