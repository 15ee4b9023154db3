"""Routes (placeholder until the protocol lands)."""

from __future__ import annotations

from starlette.routing import BaseRoute

from protocols._common.context import ProtocolContext


def data_routes(ctx: ProtocolContext) -> list[BaseRoute]:
    return []
