"""Triton / KServe v2 inference protocol over HTTP (with Triton's generate extension and
MindIE's additions)."""

from protocols.kserve_v2 import errors, routes
from server.http.routes import ProtocolSpec

SPEC = ProtocolSpec(
    name=routes.NAME,
    render=errors.render,
    routes=routes.routes,
    live_paths=frozenset({"/v2/health/live"}),
)
