"""OpenAI error surface: one table from domain error to (HTTP status, vLLM `type`), one envelope.

Body: `{"error": {"message", "type", "param", "code"}}` with `code` repeating the status, as
vLLM's `ErrorResponse`. Before the first byte that is a real response; inside a stream it is one
SSE event followed by `data: [DONE]` (PROTOCOLS.md §1.1).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from server.core.errors import (
    AdapterNotFound,
    GatewayError,
    InvalidRequest,
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


TABLE: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "BadRequestError"),
    "context_length_exceeded": (400, "BadRequestError"),
    "unsupported_media_type": (400, "BadRequestError"),
    "unsupported": (400, "BadRequestError"),
    "adapter_invalid": (400, "BadRequestError"),
    "lora_disabled": (400, "BadRequestError"),
    "invalid_user_input": (400, "InvalidUserInput"),
    "cannot_cancel": (400, "invalid_request_error"),
    "adapter_exists": (400, "InvalidUserInput"),
    "payload_too_large": (413, "RequestEntityTooLarge"),
    "unauthorized": (401, "AuthenticationError"),
    "model_not_found": (404, "NotFoundError"),
    "adapter_not_found": (404, "NotFoundError"),
    "lora_path_not_found": (404, "NotFoundError"),
    "request_not_found": (404, "NotFoundError"),
    "response_not_found": (404, "invalid_request_error"),
    "overloaded": (429, "RateLimitError"),
    "generation": (500, "InternalServerError"),
    "internal": (500, "InternalServerError"),
    "unavailable": (503, "ServiceUnavailableError"),
    "timeout": (504, "TimeoutError"),
    "adapter_capacity": (507, "InsufficientStorage"),
    "state_not_saved": (507, "InsufficientStorage"),  # the adapter state file: nothing changed
    "client_closed": (499, "ClientClosedRequest"),
}


def status_and_type(exc: GatewayError) -> tuple[int, str]:
    """The row of the closest class in the MRO that has one (new subclasses inherit a row)."""
    if isinstance(exc, InvalidFields):
        return 400, "Bad Request"
    for cls in type(exc).__mro__:
        row = TABLE.get(getattr(cls, "error_type", ""))
        if row is not None:
            return row
    return TABLE["internal"]


def error_body(exc: GatewayError) -> dict[str, Any]:
    status, kind = status_and_type(exc)
    return {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": status}}


def render(exc: GatewayError) -> Response:
    status, _ = status_and_type(exc)
    return json_response(error_body(exc), status, retry_headers(exc))


def stream_error(exc: GatewayError) -> bytes:
    """The in-band error event of a stream that already answered 200, then the terminator."""
    return sse_event(jsonio.dumps(error_body(exc))) + DONE
