"""OpenAI error surface: one table from domain error to (HTTP status, vLLM `type`), one envelope.

Body: `{"error": {"message", "type", "param", "code"}}` with `code` repeating the status, as
vLLM's `ErrorResponse`. Before the first byte that is a real response; inside a stream it is one
SSE event followed by `data: [DONE]` (PROTOCOLS.md §1.1).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from protocols.common.errors import ErrorTable
from server.core.errors import (
    AdapterCapacity,
    AdapterExists,
    AdapterInvalid,
    AdapterNotFound,
    ClientClosed,
    ContextLengthExceeded,
    DeadlineExceeded,
    EngineError,
    GatewayError,
    InvalidRequest,
    LoraDisabled,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    RequestNotFound,
    ServiceUnavailable,
    StateNotSaved,
    Unauthorized,
    Unsupported,
    UnsupportedMediaType,
)
from server.http import jsonio
from server.http.body import json_response, retry_headers
from server.http.streaming import sse_event

DONE = b"data: [DONE]\n\n"


class InvalidUserInput(InvalidRequest):
    """vLLM's type for refused LoRA load/unload requests (400)."""

    error_type = "invalid_user_input"


class InvalidFields(InvalidRequest):
    """A body that fails its wire model: vLLM (FastAPI) answers these with type "Bad Request"
    and a message listing the pydantic errors, unlike its own checks' "BadRequestError"."""


class CannotCancel(InvalidRequest):
    """vLLM: 400 `invalid_request_error` for cancelling a response that is not running."""

    error_type = "cannot_cancel"


class LoraPathNotFound(AdapterNotFound):
    """`lora_path` holds no adapter: vLLM answers 404 with `param: null`."""

    error_type = "lora_path_not_found"

    def __init__(self, message: str) -> None:
        super().__init__(message, param=None)


class ResponseNotFound(ModelNotFound):
    """vLLM: 404 `invalid_request_error` with `param: response_id`."""

    error_type = "response_not_found"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="response_id")


# (HTTP status, vLLM `type`), keyed by domain error class (closest in the MRO wins).
TABLE: ErrorTable[tuple[int, str]] = ErrorTable(
    {
        InvalidFields: (400, "Bad Request"),
        InvalidRequest: (400, "BadRequestError"),
        ContextLengthExceeded: (400, "BadRequestError"),
        UnsupportedMediaType: (400, "BadRequestError"),
        Unsupported: (400, "BadRequestError"),
        AdapterInvalid: (400, "BadRequestError"),
        LoraDisabled: (400, "BadRequestError"),
        InvalidUserInput: (400, "InvalidUserInput"),
        CannotCancel: (400, "invalid_request_error"),
        AdapterExists: (400, "InvalidUserInput"),
        PayloadTooLarge: (413, "RequestEntityTooLarge"),
        Unauthorized: (401, "AuthenticationError"),
        ModelNotFound: (404, "NotFoundError"),
        AdapterNotFound: (404, "NotFoundError"),
        LoraPathNotFound: (404, "NotFoundError"),
        RequestNotFound: (404, "NotFoundError"),
        ResponseNotFound: (404, "invalid_request_error"),
        Overloaded: (429, "RateLimitError"),
        EngineError: (500, "InternalServerError"),
        ServiceUnavailable: (503, "ServiceUnavailableError"),
        DeadlineExceeded: (504, "TimeoutError"),
        AdapterCapacity: (507, "InsufficientStorage"),
        StateNotSaved: (507, "InsufficientStorage"),  # the adapter state file: nothing changed
        ClientClosed: (499, "ClientClosedRequest"),
    },
    default=(500, "InternalServerError"),
)


def status_and_type(exc: GatewayError) -> tuple[int, str]:
    return TABLE[exc]


def error_body(exc: GatewayError) -> dict[str, Any]:
    status, kind = status_and_type(exc)
    return {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": status}}


def render(exc: GatewayError) -> Response:
    status, _ = status_and_type(exc)
    return json_response(error_body(exc), status, retry_headers(exc))


def stream_error(exc: GatewayError) -> bytes:
    """The in-band error event of a stream that already answered 200, then the terminator."""
    return sse_event(jsonio.dumps(error_body(exc))) + DONE
