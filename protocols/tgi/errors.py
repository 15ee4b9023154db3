"""TGI error table: domain errors → status and `{"error": str, "error_type": str}`.

422 `validation` (messages prefixed "Input validation error: "), 424 `generation` ("Request failed
during generation: "), 429 `overloaded`. TGI has no 404 on its native routes: an unknown
`adapter_id` is a validation error here.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from protocols.common.errors import ErrorTable
from server.core.errors import (
    AdapterCapacity,
    AdapterExists,
    ClientClosed,
    DeadlineExceeded,
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

VALIDATION_PREFIX = "Input validation error: "
GENERATION_PREFIX = "Request failed during generation: "

# (status, error_type, message prefix), keyed by domain error class (closest in the MRO wins).
_TABLE: ErrorTable[tuple[int, str, str]] = ErrorTable(
    {
        PayloadTooLarge: (413, "validation", VALIDATION_PREFIX),
        InvalidRequest: (422, "validation", VALIDATION_PREFIX),
        ModelNotFound: (422, "validation", VALIDATION_PREFIX),
        Overloaded: (429, "overloaded", ""),
        ServiceUnavailable: (503, "unhealthy", ""),
        Unauthorized: (401, "authentication", ""),
        RequestNotFound: (404, "not_found", ""),
        AdapterExists: (409, "validation", ""),
        AdapterCapacity: (507, "generation", GENERATION_PREFIX),
        DeadlineExceeded: (424, "generation", GENERATION_PREFIX),
        ClientClosed: (499, "client_closed", ""),
    },
    default=(424, "generation", GENERATION_PREFIX),
)


def classify(exc: GatewayError) -> tuple[int, dict[str, Any]]:
    status, error_type, prefix = _TABLE[exc]
    message = exc.message if exc.message.startswith(prefix) else prefix + exc.message
    return status, {"error": message, "error_type": error_type}


def render(exc: GatewayError) -> Response:
    status, body = classify(exc)
    return json_response(body, status, retry_headers(exc))


def stream_error(exc: GatewayError) -> bytes:
    """The in-band error event of a stream that already started (status stays 200)."""
    return sse_event(jsonio.dumps(classify(exc)[1]))
