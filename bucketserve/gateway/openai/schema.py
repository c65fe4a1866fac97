"""The OpenAPI 3.1 document of the HTTP port, generated from the protocol models (served
at /openapi.json)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from bucketserve.gateway.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    ResetPrefixCacheResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)

SSE = "with stream=true, server-sent events: chunks of the response, then `data: [DONE]`"
# (method, path, request body, response body, summary)
ROUTES: list[tuple[str, str, type[BaseModel] | None, type[BaseModel] | None, str]] = [
    ("post", "/v1/completions", CompletionRequest, CompletionResponse,
     f"Complete a prompt; {SSE}"),
    ("post", "/v1/chat/completions", ChatCompletionRequest, ChatCompletionResponse,
     f"Answer chat messages; {SSE} (ChatCompletionChunk objects)"),
    ("get", "/v1/models", None, ModelList, "The served model"),
    ("post", "/tokenize", TokenizeRequest, TokenizeResponse, "Token ids of a prompt"),
    ("post", "/detokenize", DetokenizeRequest, DetokenizeResponse, "Text of token ids"),
    ("get", "/version", None, VersionResponse, "The server's version"),
    ("post", "/reset_prefix_cache", None, ResetPrefixCacheResponse,
     "Every worker forgets its cached prefix blocks (vLLM's)"),
    ("get", "/health", None, None, "200 while serving, 503 while draining"),
    ("get", "/metrics", None, None, "Prometheus metrics"),
]
ERRORS = {
    "400": "a field is invalid; the message names it",
    "401": "no or an unknown API key",
    "404": "unknown model",
    "413": "the body is over gateway.max_message_bytes",
    "429": "over the tenant's limits or the queue is full; see Retry-After",
    "503": "no live worker, or shutting down",
    "504": "over gateway.http_request_timeout_s",
}


def openapi_document(title: str, version: str) -> dict[str, Any]:
    inputs = [(m, "validation") for _, _, m, _, _ in ROUTES if m is not None]
    outputs = [(m, "serialization") for _, _, _, m, _ in ROUTES if m is not None]
    extra = [(ErrorResponse, "serialization"), (ChatCompletionChunk, "serialization")]
    refs, defs = models_json_schema(
        [*inputs, *outputs, *extra], ref_template="#/components/schemas/{model}"
    )
    paths: dict[str, Any] = {}
    for method, path, request, response, summary in ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK"}}}
        if request is not None:
            schema = refs[(request, "validation")]
            op["requestBody"] = {"required": True, "content": _json(schema)}
        if response is not None:
            op["responses"]["200"]["content"] = _json(refs[(response, "serialization")])
        if request is not None:
            error = _json(refs[(ErrorResponse, "serialization")])
            op["responses"] |= {k: {"description": v, "content": error} for k, v in ERRORS.items()}
        paths[path] = {method: op}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"bearer": []}],
    }


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}
