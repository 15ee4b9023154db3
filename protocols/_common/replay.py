"""Dispatch one path to several protocols by the keys of its JSON body (MindIE's dual /generate,
SageMaker /invocations). The body is read once; `read_body` finds it in the scope afterwards."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from starlette.requests import Request
from starlette.responses import Response

from protocols._common import jsonio
from protocols._common.guard import Endpoint
from protocols._common.http import BODY_ERROR_KEY, BODY_KEY, read_body
from server.core.errors import GatewayError


def body_dispatch(
    choices: Sequence[tuple[Callable[[object], bool], Endpoint]],
    fallback: Endpoint,
    *,
    max_bytes: int,
) -> Endpoint:
    """The first endpoint whose predicate accepts the decoded body gets the request.
    Bodies that are not JSON (or too large) go to `fallback`, which reports the error itself."""

    async def dispatch(request: Request) -> Response:
        try:
            body = await read_body(request, max_bytes)
        except GatewayError as exc:
            request.scope[BODY_ERROR_KEY] = exc
            return await fallback(request)
        request.scope[BODY_KEY] = body
        try:
            data: object = jsonio.loads(body) if body.strip() else None
        except jsonio.JSONDecodeError:
            data = None
        target = next((endpoint for accepts, endpoint in choices if accepts(data)), fallback)
        return await target(request)

    return dispatch


def has_key(key: str) -> Callable[[object], bool]:
    return lambda data: isinstance(data, dict) and data.get(key) is not None
