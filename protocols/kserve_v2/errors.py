"""Triton / KServe v2 errors: one table from domain errors to Triton's status codes.

Body `{"error": "<message>"}` everywhere (Triton's envelope). Triton's own mapping: invalid
argument → 400, not found → 404, unavailable → 503, internal → 500. A body over the size limit is
413 (Triton says 400; 413 is what proxies and clients expect for that). Overload is "unavailable" in
Triton (queue full), so 503 with `Retry-After`. `stopInfer` for an unknown id answers MindIE's
404 body, which adds `"error_type": "NotFoundError"`; a bad stopInfer body (not JSON, no string
`id`, an id outside MindIE's pattern) is MindIE's 422 `"Input Validation Error"`. Stream errors
after the first event are `data: {"error": "..."}` events.
"""

from __future__ import annotations

import grpc
from starlette.responses import Response

from protocols.common.errors import ErrorTable
from server.core.errors import (
    AdapterCapacity,
    AdapterExists,
    ClientClosed,
    DeadlineExceeded,
    EngineError,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    RequestNotFound,
    ServiceUnavailable,
    Unauthorized,
)
from server.http import jsonio
from server.http.body import json_response, retry_headers
from server.http.streaming import sse_event


class StopInferInvalid(InvalidRequest):
    """A stopInfer body MindIE refuses (`SingleReqInferInterfaceBase::Stop`): its 422."""


# Keyed by domain error class (closest in the MRO wins).
STATUS: ErrorTable[int] = ErrorTable(
    {
        StopInferInvalid: 422,
        InvalidRequest: 400,
        Unauthorized: 401,
        ModelNotFound: 404,
        PayloadTooLarge: 413,
        RequestNotFound: 404,
        AdapterExists: 409,
        ClientClosed: 499,
        EngineError: 500,
        Overloaded: 503,
        ServiceUnavailable: 503,
        AdapterCapacity: 503,
        DeadlineExceeded: 504,
    },
    default=500,
)


# gRPC: Triton's mapping of its error codes, and RESOURCE_EXHAUSTED for a full server.
GRPC_STATUS: ErrorTable[grpc.StatusCode] = ErrorTable(
    {
        InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
        Unauthorized: grpc.StatusCode.UNAUTHENTICATED,
        ModelNotFound: grpc.StatusCode.NOT_FOUND,
        PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
        RequestNotFound: grpc.StatusCode.NOT_FOUND,
        AdapterExists: grpc.StatusCode.ALREADY_EXISTS,
        ClientClosed: grpc.StatusCode.CANCELLED,
        EngineError: grpc.StatusCode.INTERNAL,
        Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
        ServiceUnavailable: grpc.StatusCode.UNAVAILABLE,
        AdapterCapacity: grpc.StatusCode.UNAVAILABLE,
        DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    },
    default=grpc.StatusCode.INTERNAL,
)

# MindIE's `error_type` on the stopInfer answers it shares with this protocol; none elsewhere.
MINDIE_TYPES: ErrorTable[str | None] = ErrorTable(
    {RequestNotFound: "NotFoundError", StopInferInvalid: "Input Validation Error"}, default=None
)


def grpc_status(exc: GatewayError) -> grpc.StatusCode:
    return GRPC_STATUS[exc]


def status_of(exc: GatewayError) -> int:
    return STATUS[exc]


def body_of(exc: GatewayError) -> dict[str, str]:
    error_type = MINDIE_TYPES[exc]
    if error_type is None:
        return {"error": exc.message}
    return {"error": exc.message, "error_type": error_type}


def render(exc: GatewayError) -> Response:
    return json_response(body_of(exc), status_of(exc), retry_headers(exc))


def stream_error(exc: GatewayError) -> bytes:
    return sse_event(jsonio.dumps({"error": exc.message}))
