"""Request bodies: bounded reading, JSON parsing and wire-model validation, JSON responses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from protocols._common import jsonio
from server.core.errors import (
    GatewayError,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
    ServiceUnavailable,
    UnsupportedMediaType,
)

ModelT = TypeVar("ModelT", bound=BaseModel)
JSON_TYPE = "application/json"
BODY_KEY = "gateway.body"  # set when a dispatcher already read the body
BODY_ERROR_KEY = "gateway.body_error"
ADMIN_KEY = "gateway.admin"  # set by the auth middleware; absent when no keys are configured


async def read_body(request: Request, max_bytes: int) -> bytes:
    """Read the whole body, refusing more than `max_bytes` (chunked bodies included)."""
    if BODY_ERROR_KEY in request.scope:
        raise request.scope[BODY_ERROR_KEY]
    if BODY_KEY in request.scope:
        cached: bytes = request.scope[BODY_KEY]
        return cached
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"Request body is larger than the limit of {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLarge(f"Request body is larger than the limit of {max_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # gone mid-body (or cut off by the receive deadline): nobody reads the answer, and a
        # traceback per dropped slow client would flood the log
        raise InvalidRequest("The client disconnected before the request body arrived") from None
    return b"".join(chunks)


async def read_json(request: Request, max_bytes: int, *, strict_content_type: bool = False) -> Any:
    """Read and decode a JSON body. `strict_content_type` requires application/json (vLLM)."""
    if strict_content_type:
        content_type = request.headers.get("content-type", "")
        if content_type.split(";", 1)[0].strip().lower() != JSON_TYPE:
            raise UnsupportedMediaType("Unsupported Media Type: Only 'application/json' is allowed")
    return decode_json(await read_body(request, max_bytes))


def decode_json(body: bytes) -> Any:
    if not body.strip():
        raise InvalidRequest("The request body is empty; a JSON object was expected")
    try:
        return jsonio.loads(body)
    except jsonio.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None


def parse_model(model: type[ModelT], data: Any) -> ModelT:
    """Validate `data` against a wire model; the first error's path becomes `param`."""
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise to_invalid_request(exc) from None


def to_invalid_request(exc: ValidationError) -> InvalidRequest:
    errors = exc.errors(include_url=False, include_input=False)
    lines = [f"  {'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:10]]
    count = len(errors)
    message = f"{count} validation error{'s' if count != 1 else ''}:\n" + "\n".join(lines)
    first = errors[0]["loc"] if errors else ()
    param = ".".join(str(p) for p in first) or None
    return InvalidRequest(message, param=param)


def json_response(
    content: Any, status_code: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return Response(jsonio.dumps(content), status_code, headers, media_type=JSON_TYPE)


def request_id_header(request: Request) -> str | None:
    value = request.headers.get("x-request-id")
    return value if value and len(value) <= 256 else None


def retry_headers(exc: GatewayError) -> dict[str, str] | None:
    """`Retry-After` for the errors a client should retry later (overload, draining, starting)."""
    if isinstance(exc, Overloaded | ServiceUnavailable):
        return {"retry-after": str(exc.retry_after_s)}
    return None
