"""The errors both sides of the API share: one class per gRPC status, with its HTTP twin.

The server raises them and maps each to its status (gRPC) or code and OpenAI
error type (HTTP); the SDK raises the same class for the status it receives.
"""

from __future__ import annotations

import logging

import grpc

from bucketserve.messages import NoWorkersError, QueueFullError

logger = logging.getLogger(__name__)


class BucketServeError(Exception):
    """Base of every error the service or the SDK raises on purpose."""

    code = grpc.StatusCode.UNKNOWN
    http_status = 500
    openai_type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgumentError(BucketServeError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    openai_type = "invalid_request_error"


class AuthenticationError(BucketServeError):
    code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401
    openai_type = "authentication_error"


class PermissionDeniedError(BucketServeError):
    code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403
    openai_type = "permission_error"


class NotFoundError(BucketServeError):
    code = grpc.StatusCode.NOT_FOUND
    http_status = 404
    openai_type = "not_found_error"


class ResourceExhaustedError(BucketServeError):
    """Queue full or tenant over quota; `retry_after_s` says when trying again may succeed."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    openai_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceededError(BucketServeError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504
    openai_type = "timeout_error"


class UnavailableError(BucketServeError):
    """No live worker, the server is shutting down, or it cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    openai_type = "service_unavailable_error"


class RequestCancelledError(BucketServeError):
    code = grpc.StatusCode.CANCELLED
    http_status = 499
    openai_type = "cancelled_error"


class InternalError(BucketServeError):
    """A bug in the service; the message is safe to show, the details are in the server log."""

    code = grpc.StatusCode.INTERNAL
    http_status = 500
    openai_type = "server_error"


class GenerationError(BucketServeError):
    """An admitted request ended with finish reason `error` (say, every worker died)."""

    code = grpc.StatusCode.INTERNAL
    http_status = 500
    openai_type = "server_error"


_BY_CODE: dict[grpc.StatusCode, type[BucketServeError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        AuthenticationError,
        PermissionDeniedError,
        NotFoundError,
        ResourceExhaustedError,
        DeadlineExceededError,
        UnavailableError,
        RequestCancelledError,
        InternalError,
    )
}


def error_for_status(
    code: grpc.StatusCode, message: str, retry_after_s: float | None = None
) -> BucketServeError:
    """The SDK's exception for a gRPC status."""
    cls = _BY_CODE.get(code, BucketServeError)
    if cls is ResourceExhaustedError:
        return ResourceExhaustedError(message, 1.0 if retry_after_s is None else retry_after_s)
    error = cls(message)
    if cls is BucketServeError:
        error.code = code
    return error


def from_backend(exc: Exception) -> BucketServeError:
    """The gateway's error for what the backend raised while admitting a request."""
    if isinstance(exc, BucketServeError):
        return exc
    if isinstance(exc, ValueError):
        return InvalidArgumentError(str(exc))
    if isinstance(exc, QueueFullError):
        return ResourceExhaustedError(str(exc), exc.retry_after_s)
    if isinstance(exc, NoWorkersError):
        return UnavailableError(str(exc))
    logger.error("the backend failed to admit a request", exc_info=exc)
    return InternalError("the server failed to queue the request; see its log")


class PayloadTooLargeError(InvalidArgumentError):
    """An HTTP body over gateway.max_message_bytes (gRPC refuses such a message itself)."""

    http_status = 413
