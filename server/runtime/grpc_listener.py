"""The gRPC listener (`ServerConfig.grpcPort`): one grpc.aio server on the gateway's event loop
with every protocol's gRPC services and grpc.health.v1.

Its port is bound before the engine starts (a taken port stops the start at once, as the HTTP
listeners' do: server/runtime/ports.py); it serves once the engine is up (as Triton opens its
endpoints after loading its models: calls made meanwhile wait in the port's backlog), with mutual
TLS from the `grpc*` fields (each falling back to the data listener's), a message limit of
`maxRequestLength`, and the same bearer keys as HTTP. On stop it closes after the drain.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio

from server.gateway import Gateway
from server.runtime.ports import check_free, unavailable
from server.runtime.tls import (
    check_bind_address,
    grpc_credentials,
    revocation_check,
    tls_files,
)
from server.settings import Settings

if TYPE_CHECKING:
    from server.http.rpc import Handler

logger = logging.getLogger("gateway")
CLOSE_GRACE_S = 5.0  # after the drain, how long calls still open get before they are cancelled


@dataclass(frozen=True, slots=True)
class GrpcPlan:
    """What the gRPC listener needs, checked before the engine starts (bad TLS files fail at
    once, as the HTTP listeners' do)."""

    host: str
    port: int
    credentials: grpc.ServerCredentials | None  # None: plaintext
    peer_allowed: Callable[[bytes], bool] | None  # the CRL check of client certificates
    max_message_bytes: int
    shared: bool = False  # bound by every worker process (SO_REUSEPORT)


def plan_grpc(
    settings: Settings, *, shared: bool = False, port: int | None = None
) -> GrpcPlan | None:
    """None when no `grpcPort` is configured. `shared`: each worker process binds the port
    (SO_REUSEPORT: the kernel spreads connections over them), the one its supervisor reserved
    (`port`: `grpcPort` 0 resolved)."""
    listener = settings.server.grpc
    if listener.port is None:
        return None
    files = tls_files(settings, "grpc")
    check_bind_address(settings.server, listener.host, files is not None)
    return GrpcPlan(
        host=listener.host,
        port=listener.port if port is None else port,
        credentials=grpc_credentials(files) if files else None,
        peer_allowed=revocation_check(files) if files else None,
        max_message_bytes=settings.server.max_request_bytes,
        shared=shared,
    )


class LateInterceptor(aio.ServerInterceptor):
    """The gateway's interceptor, known only once the engine is up (the server, which takes its
    interceptors when built, is built before: it holds the port); set exactly once."""

    def __init__(self) -> None:
        self._inner: aio.ServerInterceptor | None = None

    def serve(self, inner: aio.ServerInterceptor) -> None:
        assert self._inner is None, "the gRPC interceptor is set once"
        self._inner = inner

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        assert self._inner is not None, "the server starts only once the gateway is built"
        handler: Handler | None = await self._inner.intercept_service(continuation, details)
        return handler


@dataclass(frozen=True, slots=True)
class BoundGrpc:
    """A gRPC server holding its port (the plan's, 0 resolved), not yet serving."""

    plan: GrpcPlan
    server: aio.Server
    access: LateInterceptor

    @property
    def address(self) -> str:
        return f"{self.plan.host}:{self.plan.port}"


def bind_grpc(plan: GrpcPlan | None) -> BoundGrpc | None:
    """Build the gRPC server and bind its port (PortUnavailable if taken); serve it later with
    `start_grpc`. Called on the event loop that will serve it."""
    if plan is None:
        return None
    if not plan.shared:  # a worker joins the port its supervisor checked and reserved
        check_free(plan.host, plan.port, ("grpc",))
    access = LateInterceptor()
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", plan.max_message_bytes),
        ("grpc.max_send_message_length", -1),
        # a second server on the same port must fail, not share, unless it is a sibling worker
        ("grpc.so_reuseport", int(plan.shared)),
    ]
    server = aio.server(interceptors=[access], options=options)
    address = f"{plan.host}:{plan.port}"
    try:
        if plan.credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, plan.credentials)
    except RuntimeError as exc:  # grpc says only "Failed to bind" (its own log line says why)
        raise unavailable(plan.host, plan.port, ("grpc",), str(exc).split(";")[0]) from None
    return BoundGrpc(plan=replace(plan, port=port), server=server, access=access)


async def start_grpc(gateway: Gateway, bound: BoundGrpc | None) -> aio.Server | None:
    """Serve the bound port with every protocol's gRPC services."""
    if bound is None:
        return None
    bound.access.serve(gateway.grpc_interceptor(bound.plan.peer_allowed))
    for service in gateway.grpc_services:
        service.add_to(bound.server)
    await bound.server.start()
    tls = "mutual TLS" if bound.plan.credentials else "plaintext"
    logger.info("gRPC: %s (%s)", bound.address, tls)
    return bound.server


async def stop_grpc(server: aio.Server | None) -> None:
    if server is not None:
        await server.stop(CLOSE_GRACE_S)
