"""Huawei MindIE's native inference API, and its control plane on the management listener."""

from collections.abc import Sequence

from protocols.mindie import control, errors, metrics, routes
from server.http.context import ProtocolContext
from server.http.routes import ProtocolSpec, Route


def management_routes(ctx: ProtocolContext) -> Sequence[Route]:
    """The control plane and /metrics-json (none without the server port)."""
    if ctx.server is None:
        return []
    return [*control.routes(ctx.service, ctx.server), *metrics.routes(ctx.service, ctx.server)]


SPEC = ProtocolSpec(
    name=routes.NAME,
    render=errors.render,
    routes=routes.routes,
    live_paths=control.LIVE_PATHS,
    paths=frozenset({"/infer", "/infer_token", "/v1/tokenizer"}),
    management=management_routes,
    unrouted=control.UNROUTED,
)
