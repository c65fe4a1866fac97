"""bucketserve: disaggregated prefill/decode LLM serving.

The public Python API is the client SDK of the gRPC service:

    from bucketserve import Client, SamplingParams

    with Client("localhost:50051") as client:
        print(client.generate("Hello", SamplingParams(max_tokens=32)).text)

Everything is inside this package. Its subpackages are the service's parts: `gateway`
(gRPC and OpenAI-compatible HTTP, and this SDK), `controller`, `bucket_manager`,
`prefill_worker`, `decode_worker`, `kv_transfer`, `runtime` (the engine), `deploy`
(`bucketserve serve` and its recipes) and `bench` (`bucketserve bench`); `messages` holds
what crosses a process boundary. docs/architecture.md maps them. Exports resolve lazily,
so `import bucketserve` and `bucketserve --help` stay quick and import no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Client": "bucketserve.gateway.client",
    "AsyncClient": "bucketserve.gateway.async_client",
    "SamplingParams": "bucketserve.runtime.core.sampling_params",
    "StructuredOutputsParams": "bucketserve.runtime.core.structured_outputs",
    "RetryPolicy": "bucketserve.gateway.retry_policy",
    "Chunk": "bucketserve.gateway.sdk_types",
    "Completion": "bucketserve.gateway.sdk_types",
    "ModelInfo": "bucketserve.gateway.sdk_types",
    "Tool": "bucketserve.gateway.sdk_types",
    "ToolCall": "bucketserve.gateway.sdk_types",
    "ToolChoice": "bucketserve.gateway.sdk_types",
    "BucketServeError": "bucketserve.gateway.errors",
    "InvalidArgumentError": "bucketserve.gateway.errors",
    "AuthenticationError": "bucketserve.gateway.errors",
    "PermissionDeniedError": "bucketserve.gateway.errors",
    "NotFoundError": "bucketserve.gateway.errors",
    "ResourceExhaustedError": "bucketserve.gateway.errors",
    "DeadlineExceededError": "bucketserve.gateway.errors",
    "UnavailableError": "bucketserve.gateway.errors",
    "RequestCancelledError": "bucketserve.gateway.errors",
    "InternalError": "bucketserve.gateway.errors",
    "GenerationError": "bucketserve.gateway.errors",
}

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "BucketServeError",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceededError",
    "GenerationError",
    "InternalError",
    "InvalidArgumentError",
    "ModelInfo",
    "NotFoundError",
    "PermissionDeniedError",
    "RequestCancelledError",
    "ResourceExhaustedError",
    "RetryPolicy",
    "SamplingParams",
    "StructuredOutputsParams",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "UnavailableError",
]

if TYPE_CHECKING:
    from bucketserve.gateway.async_client import AsyncClient
    from bucketserve.gateway.client import Client
    from bucketserve.gateway.errors import (
        AuthenticationError,
        BucketServeError,
        DeadlineExceededError,
        GenerationError,
        InternalError,
        InvalidArgumentError,
        NotFoundError,
        PermissionDeniedError,
        RequestCancelledError,
        ResourceExhaustedError,
        UnavailableError,
    )
    from bucketserve.gateway.retry_policy import RetryPolicy
    from bucketserve.gateway.sdk_types import (
        Chunk,
        Completion,
        ModelInfo,
        Tool,
        ToolCall,
        ToolChoice,
    )
    from bucketserve.runtime.core.sampling_params import SamplingParams
    from bucketserve.runtime.core.structured_outputs import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bucketserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
