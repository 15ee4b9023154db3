"""DJL error tables: domain errors → status and body, one table per kind of route.

- Management routes (`/models/{m}/adapters…`, `/adapters…`): DJL's Java `ErrorResponse`
  `{"code", "type", "message"}` (Gson pretty print + newline); 400 BadRequestException for what
  the Java front checks (parameters, LoRA enabled), 404, 405, 409 IllegalArgumentException
  (adapter exists), 424 when the handler fails to register or update (bad path or files, pin
  without preload, the engine refusing it), 503, 507 (no free lora slots; and, as DJL answers
  what it cannot store, 507 InternalServerException when the adapter state file cannot be
  written: the change was not made).
- Inference routes (`/invocations`, `/predictions/{m}`): LMI's handler errors `{"error", "code"}`
  with 424 for invalid input and unregistered adapters ("Adapter X is not registered"), 424
  `{"code", "message": "invoke handler failure", "error"}` for generation failures, and the Java
  shape for what the Java front answers itself: 404 unknown model/workflow, 413, 503, 507.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from protocols.common.errors import ErrorTable
from protocols.djl.translate import djl_json, error_body
from server.core.errors import (
    AdapterCapacity,
    AdapterExists,
    AdapterInvalid,
    AdapterNotFound,
    ClientClosed,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    RequestNotFound,
    ServiceUnavailable,
    StateNotSaved,
    Unauthorized,
)
from server.http import jsonio
from server.http.body import retry_headers

JSON = "application/json"


class MethodNotAllowed(GatewayError):
    error_type = "method_not_allowed"

    def __init__(self) -> None:
        super().__init__("Requested method is not allowed, please refer to API document.")


# (status, Java exception type), keyed by domain error class (closest in the MRO wins).
# AdapterInvalid is what DJL's Python handler refuses (adapter_manager_mixin.py: bad path,
# pin without preload, add_lora failing): its 424 reaches the client as a BadRequestException.
_MANAGEMENT: ErrorTable[tuple[int, str]] = ErrorTable(
    {
        PayloadTooLarge: (413, "BadRequestException"),
        AdapterInvalid: (424, "BadRequestException"),
        InvalidRequest: (400, "BadRequestException"),
        ModelNotFound: (404, "BadRequestException"),
        RequestNotFound: (404, "BadRequestException"),
        MethodNotAllowed: (405, "MethodNotAllowedException"),
        AdapterExists: (409, "IllegalArgumentException"),
        AdapterCapacity: (507, "BadRequestException"),
        StateNotSaved: (507, "InternalServerException"),
        Overloaded: (503, "WlmCapacityException"),
        ServiceUnavailable: (503, "ServiceUnavailableException"),
        Unauthorized: (401, "BadRequestException"),
    },
    default=(500, "InternalServerException"),
)


def management_status(exc: GatewayError) -> tuple[int, str]:
    return _MANAGEMENT[exc]


def render_management(exc: GatewayError) -> Response:
    status, java_type = management_status(exc)
    body = djl_json(error_body(status, java_type, exc.message))
    return Response(body, status, retry_headers(exc), media_type=JSON)


# (status, Java type); None as the type means LMI's handler shape {"error", "code"}, and the
# default (no row) its generation failure {"code", "message": "invoke handler failure", "error"}.
_INFERENCE: ErrorTable[tuple[int, str | None] | None] = ErrorTable(
    {
        AdapterNotFound: (424, None),
        ModelNotFound: (404, "ModelNotFoundException"),
        PayloadTooLarge: (413, "TooLongFrameException"),
        InvalidRequest: (424, None),
        Overloaded: (503, "ServiceUnavailableException"),
        ServiceUnavailable: (503, "ServiceUnavailableException"),
        AdapterCapacity: (507, "BadRequestException"),
        Unauthorized: (401, "BadRequestException"),
        ClientClosed: (499, "ChannelClosedException"),
    },
    default=None,
)


def inference_error(exc: GatewayError) -> tuple[int, dict[str, Any]]:
    """Status and body of an inference error (before any output was sent)."""
    row = _INFERENCE[exc]
    if row is None:
        return 424, {"code": 424, "message": "invoke handler failure", "error": exc.message}
    status, java_type = row
    if java_type is None:
        return status, {"error": exc.message, "code": status}
    return status, error_body(status, java_type, exc.message)


def render(exc: GatewayError) -> Response:
    status, body = inference_error(exc)
    return Response(jsonio.dumps(body), status, retry_headers(exc), media_type=JSON)
