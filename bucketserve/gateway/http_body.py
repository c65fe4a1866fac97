"""An HTTP request body as text, refused before any parsing work when it is too large
(413) or not UTF-8 (400)."""

from __future__ import annotations

from aiohttp import web

from bucketserve.gateway.errors import InvalidArgumentError, PayloadTooLargeError


async def read_text(request: web.Request, limit: int) -> str:
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


def _too_large(length: int | None, limit: int) -> PayloadTooLargeError:
    size = "more" if length is None else f"{length} bytes, more"
    return PayloadTooLargeError(
        f"the request body is {size} than this server's limit of {limit} bytes "
        "(gateway.max_message_bytes); send a shorter prompt"
    )
