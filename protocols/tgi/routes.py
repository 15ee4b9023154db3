"""TGI routes: /generate, /generate_stream, POST /, /info, /health, /tokenize."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from protocols._common.context import ProtocolContext
from protocols._common.guard import Endpoint
from protocols._common.http import json_response


async def _todo(request: Request) -> Response:
    return PlainTextResponse("not implemented yet", status_code=501)


def health(ctx: ProtocolContext) -> Endpoint:
    """TGI /health: 200 with an empty body when serving, else 503 with TGI's error body."""

    async def endpoint(request: Request) -> Response:
        if ctx.service.lifecycle.accepting:
            return Response(status_code=200)
        return json_response({"error": "unhealthy", "error_type": "healthcheck"}, 503)

    return endpoint


def data_routes(ctx: ProtocolContext) -> list[BaseRoute]:
    return [
        Route("/health", health(ctx), methods=["GET"]),
        Route("/", health(ctx), methods=["GET"]),
    ]


def generate(ctx: ProtocolContext) -> Endpoint:
    return _todo


def tokenize(ctx: ProtocolContext) -> Endpoint:
    return _todo
