"""Triton / KServe v2 inference protocol over HTTP (with Triton's generate extension and
MindIE's additions)."""

from protocols.kserve_v2 import errors, grpc_api, routes
from protocols.kserve_v2.stats import stats_of
from server.http.context import ProtocolContext
from server.http.routes import ProtocolSpec
from server.http.rpc import GrpcService


def _grpc(ctx: ProtocolContext) -> list[GrpcService]:
    return grpc_api.services(ctx, stats_of(ctx))


SPEC = ProtocolSpec(
    name=routes.NAME,
    render=errors.render,
    routes=routes.routes,
    live_paths=frozenset({"/v2/health/live"}),
    paths=frozenset({
        "/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/stats", "/v2/repository/index",
        "/v2/models/{model:path}",
    }),
    grpc=_grpc,
)
