"""Endpoint guard: every failure becomes the protocol's own error response, never a bare 500."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from server.core.errors import EngineError, GatewayError

Endpoint = Callable[[Request], Awaitable[Response]]
Renderer = Callable[[GatewayError], Response]

logger = logging.getLogger("gateway.protocols")


def guarded(render: Renderer) -> Callable[[Endpoint], Endpoint]:
    """Wrap an endpoint so GatewayError renders through `render`, and anything else is logged
    with its traceback and answered as a generic engine error (no internals leak)."""

    def decorate(endpoint: Endpoint) -> Endpoint:
        @functools.wraps(endpoint)
        async def run(request: Request) -> Response:
            try:
                return await endpoint(request)
            except GatewayError as exc:
                return render(exc)
            except Exception:
                logger.exception("unexpected error in %s", request.url.path)
                return render(EngineError("Internal error while handling the request"))

        return run

    return decorate
