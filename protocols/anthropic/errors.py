"""Anthropic error surface: domain error → (HTTP status, Anthropic error type), one envelope.

Body: `{"type": "error", "error": {"type", "message"}}` (Anthropic's documented shape, which the
`anthropic` SDK reads into its exception classes by status). Before the first byte that is a
real response with a `request-id` header; inside a stream it is one `event: error` frame.
A gateway that cannot take a request now (starting, draining, engine gone, adapter slots full)
answers Anthropic's 529 `overloaded_error`; a full queue is 429 `rate_limit_error`.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from protocols.common.errors import ErrorTable
from server.core.errors import (
    AdapterCapacity,
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
from server.http.context import current_request_id

# (HTTP status, Anthropic error type), keyed by domain error class (closest in the MRO wins).
_TABLE: ErrorTable[tuple[int, str]] = ErrorTable(
    {
        PayloadTooLarge: (413, "request_too_large"),
        InvalidRequest: (400, "invalid_request_error"),
        Unauthorized: (401, "authentication_error"),
        ModelNotFound: (404, "not_found_error"),
        RequestNotFound: (404, "not_found_error"),
        Overloaded: (429, "rate_limit_error"),
        ServiceUnavailable: (529, "overloaded_error"),
        AdapterCapacity: (529, "overloaded_error"),
        DeadlineExceeded: (504, "timeout_error"),
        ClientClosed: (499, "api_error"),
    },
    default=(500, "api_error"),
)


def status_and_type(exc: GatewayError) -> tuple[int, str]:
    return _TABLE[exc]


def error_body(exc: GatewayError) -> dict[str, Any]:
    _, kind = status_and_type(exc)
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def render(exc: GatewayError) -> Response:
    status, _ = status_and_type(exc)
    headers = {"request-id": current_request_id(), **(retry_headers(exc) or {})}
    return json_response(error_body(exc), status, headers)


def stream_error(exc: GatewayError) -> bytes:
    """The in-band `error` event of a stream that already answered 200."""
    return b"event: error\ndata: " + jsonio.dumps(error_body(exc)) + b"\n\n"
