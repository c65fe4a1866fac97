"""gRPC's rich error model both ways: a `google.rpc.Status` in the trailers, with
`google.rpc.RetryInfo` when waiting may help, and the plain `retry-after` trailer that
older SDKs read."""

from __future__ import annotations

from typing import Any

from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from bucketserve.gateway.errors import BucketServeError, ResourceExhaustedError

RETRY_AFTER = "retry-after"
STATUS_DETAILS = "grpc-status-details-bin"


def status_trailers(error: BucketServeError) -> tuple[tuple[str, Any], ...]:
    # google.rpc.Code numbers are grpc.StatusCode's
    status = status_pb2.Status(code=error.code.value[0], message=error.message)
    trailers: tuple[tuple[str, Any], ...] = ()
    if isinstance(error, ResourceExhaustedError):
        info = error_details_pb2.RetryInfo()
        info.retry_delay.FromNanoseconds(round(error.retry_after_s * 1e9))
        detail = any_pb2.Any()
        detail.Pack(info)
        status.details.append(detail)
        trailers = ((RETRY_AFTER, f"{error.retry_after_s:g}"),)
    return (*trailers, *rpc_status.to_status(status).trailing_metadata)


def retry_delay(trailing: Any) -> float | None:
    """Seconds from RetryInfo, else from the `retry-after` trailer; None if neither."""
    fallback = None
    for key, value in trailing or ():
        if key == STATUS_DETAILS:
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    return info.retry_delay.ToNanoseconds() / 1e9
        elif key == RETRY_AFTER:
            fallback = float(value)
    return fallback
