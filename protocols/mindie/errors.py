"""MindIE error table: domain errors → status and `{"error": str, "error_type": <reason text>}`.

MindIE's `error_type` is the HTTP reason text of its own table (`http_rest_resource.h`):
400 "Bad Request", 404 "NotFoundError", 422 "Input Validation Error", 424 "Generation Error",
500 "Incomplete Generation", 503 "Service Unavailable". MindIE has no 429; an overloaded gateway
answers 429 "Too Many Requests" with Retry-After so clients back off instead of failing.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from protocols.common.errors import ErrorTable
from server.core.errors import (
    AdapterCapacity,
    AdapterExists,
    ClientClosed,
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

# (status, reason text), keyed by domain error class (closest in the MRO wins).
TABLE: ErrorTable[tuple[int, str]] = ErrorTable(
    {
        PayloadTooLarge: (413, "Payload Too Large"),
        InvalidRequest: (422, "Input Validation Error"),
        ModelNotFound: (404, "NotFoundError"),
        RequestNotFound: (404, "NotFoundError"),
        Overloaded: (429, "Too Many Requests"),
        ServiceUnavailable: (503, "Service Unavailable"),
        Unauthorized: (401, "Unauthorized"),
        AdapterExists: (409, "Conflict"),
        AdapterCapacity: (507, "Insufficient Storage"),
        ClientClosed: (499, "Client Closed Request"),
    },
    default=(500, "Incomplete Generation"),
)


def classify(exc: GatewayError) -> tuple[int, dict[str, Any]]:
    status, reason = TABLE[exc]
    return status, {"error": exc.message, "error_type": reason}


def render(exc: GatewayError) -> Response:
    status, body = classify(exc)
    return json_response(body, status, retry_headers(exc))


def stream_error(exc: GatewayError) -> bytes:
    """In-band error of an `/infer` stream that already started."""
    return sse_event(jsonio.dumps(classify(exc)[1]))


def chunk_error(exc: GatewayError) -> bytes:
    """In-band error of a vLLM-flavour `/generate` stream (NUL-terminated JSON chunks)."""
    return jsonio.dumps(classify(exc)[1]) + b"\0"
