"""Request bodies (bounded reading, JSON, wire-model validation) and JSON responses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from server.core.errors import (
    GatewayError,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
    ServiceUnavailable,
    UnsupportedMediaType,
)
from server.http import jsonio
from server.http.context import BODY_ERROR_KEY, BODY_KEY, CLIENT_ID_KEY, MAX_REQUEST_ID

ModelT = TypeVar("ModelT", bound=BaseModel)
JSON_TYPE = "application/json"


def too_large(max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body is larger than the limit of {max_bytes} bytes")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """Read the whole body, refusing more than `max_bytes` (chunked bodies included)."""
    scope = request.scope
    if BODY_KEY in scope:
        cached: bytes = scope[BODY_KEY]
        return cached
    if BODY_ERROR_KEY in scope:
        raise scope[BODY_ERROR_KEY]
    # (a declared Content-Length beyond the limit was refused by the listener app already)
    chunks: list[bytes] = []
    size = 0
    receive = request.receive
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            # gone mid-body (or cut off by the receive deadline): nobody reads the answer, and
            # a traceback per dropped slow client would flood the log
            raise InvalidRequest("The client disconnected before the request body arrived")
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    scope[BODY_KEY] = body
    return body


async def read_json(request: Request, max_bytes: int, *, strict_content_type: bool = False) -> Any:
    """Read and decode a JSON body. `strict_content_type` requires application/json (vLLM)."""
    if strict_content_type and _media_type(request.scope) != _JSON_BYTES:
        raise UnsupportedMediaType("Unsupported Media Type: Only 'application/json' is allowed")
    return decode_json(await read_body(request, max_bytes))


def _media_type(scope: Scope) -> bytes:
    """The request's Content-Type without parameters, lower-cased (the first header, as
    Starlette's `request.headers` reads it; without building that mapping per request)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            media: bytes = value.split(b";", 1)[0].strip().lower()
            return media
    return b""


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


class JsonResponse(Response):
    """A JSON answer built without Starlette's header machinery (every answer pays it)."""

    media_type = JSON_TYPE

    def __init__(
        self, body: bytes, status_code: int = 200, headers: Mapping[str, str] | None = None
    ) -> None:
        self.status_code = status_code
        self.body = body
        self.background = None
        self.raw_headers = [(b"content-length", str(len(body)).encode()), _JSON_HEADER]
        if headers:
            self.raw_headers += [
                (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
            ]


_JSON_BYTES = JSON_TYPE.encode()
_JSON_HEADER = (b"content-type", _JSON_BYTES)


def json_response(
    content: Any, status_code: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return JsonResponse(jsonio.dumps(content), status_code, headers)


def request_id_header(request: Request) -> str | None:
    """The client's `X-Request-Id`, if it gave a usable one (the listener app then serves the
    request under it); None otherwise."""
    scope = request.scope
    if CLIENT_ID_KEY in scope:  # the listener app read the header already (None: no usable one)
        given: str | None = scope[CLIENT_ID_KEY]
        return given
    value = request.headers.get("x-request-id")
    return value if value and len(value) <= MAX_REQUEST_ID else None


def retry_headers(exc: GatewayError) -> dict[str, str] | None:
    """`Retry-After` for the errors a client should retry later (overload, draining, starting)."""
    if isinstance(exc, Overloaded | ServiceUnavailable):
        return {"retry-after": str(exc.retry_after_s)}
    return None
