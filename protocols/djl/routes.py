"""Routes (placeholder until the protocol lands)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute

from protocols._common.context import ProtocolContext
from protocols._common.guard import Endpoint


async def _todo(request: Request) -> Response:
    return PlainTextResponse("not implemented yet", status_code=501)


def data_routes(ctx: ProtocolContext) -> list[BaseRoute]:
    return []


def invocations(ctx: ProtocolContext) -> Endpoint:
    return _todo
