"""`grpc.health.v1.Health` for Kubernetes gRPC probes, from the lifecycle: SERVING while the
server admits requests, NOT_SERVING while it drains, stops or has failed. As in Triton the
service name is not looked at (every name gets the server's answer); `Watch` streams changes
too (Triton has only `Check`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from server.core.lifecycle import Lifecycle
from server.http.rpc import GrpcService

if TYPE_CHECKING:
    from server.http.rpc import Context

SERVICE = "grpc.health.v1.Health"
WATCH_INTERVAL_S = 0.5
Status = health_pb2.HealthCheckResponse


class LifecycleHealth(health_pb2_grpc.HealthServicer):
    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle

    def _status(self) -> Any:
        return Status.SERVING if self._lifecycle.accepting else Status.NOT_SERVING

    async def Check(self, request: Any, context: Context) -> Any:
        return Status(status=self._status())

    async def Watch(self, request: Any, context: Context) -> AsyncIterator[Any]:
        last = None
        while True:
            status = self._status()
            if status != last:
                last = status
                yield Status(status=status)
            await asyncio.sleep(WATCH_INTERVAL_S)


def health_service(lifecycle: Lifecycle) -> GrpcService:
    servicer = LifecycleHealth(lifecycle)
    return GrpcService(
        name=SERVICE,
        owner="health",
        add_to=lambda server: health_pb2_grpc.add_HealthServicer_to_server(servicer, server),
        open_methods=frozenset({f"/{SERVICE}/Check", f"/{SERVICE}/Watch"}),
    )
