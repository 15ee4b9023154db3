"""The gRPC listener (`ServerConfig.grpcPort`): one grpc.aio server on the gateway's event loop
with every protocol's gRPC services and grpc.health.v1.

It starts once the engine is up (as Triton opens its endpoints after loading its models), with
mutual TLS from the `grpc*` fields (each falling back to the data listener's), a message limit of
`maxRequestLength`, and the same bearer keys as HTTP. On stop it closes after the drain.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc import aio

from server.gateway import Gateway
from server.runtime.tls import (
    check_bind_address,
    grpc_credentials,
    revocation_check,
    tls_files,
)
from server.settings import Settings

logger = logging.getLogger("gateway")
CLOSE_GRACE_S = 5.0  # after the drain, how long calls still open get before they are cancelled


@dataclass(frozen=True, slots=True)
class GrpcPlan:
    """What the gRPC listener needs, checked before the engine starts (bad TLS files fail at
    once, as the HTTP listeners' do)."""

    address: str
    credentials: grpc.ServerCredentials | None  # None: plaintext
    peer_allowed: Callable[[bytes], bool] | None  # the CRL check of client certificates
    max_message_bytes: int
    shared: bool = False  # bound by every worker process (SO_REUSEPORT)


def plan_grpc(settings: Settings, *, shared: bool = False) -> GrpcPlan | None:
    """None when no `grpcPort` is configured. `shared`: each worker process binds the port
    (SO_REUSEPORT: the kernel spreads connections over them)."""
    listener = settings.server.grpc
    if listener.port is None:
        return None
    files = tls_files(settings, "grpc")
    check_bind_address(settings.server, listener.host, files is not None)
    return GrpcPlan(
        address=f"{listener.host}:{listener.port}",
        credentials=grpc_credentials(files) if files else None,
        peer_allowed=revocation_check(files) if files else None,
        max_message_bytes=settings.server.max_request_bytes,
        shared=shared,
    )


async def start_grpc(gateway: Gateway, plan: GrpcPlan | None) -> aio.Server | None:
    if plan is None:
        return None
    server = aio.server(
        interceptors=[gateway.grpc_interceptor(plan.peer_allowed)],
        options=[
            ("grpc.max_receive_message_length", plan.max_message_bytes),
            ("grpc.max_send_message_length", -1),
            # a second server on the same port must fail, not share, unless it is a sibling worker
            ("grpc.so_reuseport", int(plan.shared)),
        ],
    )
    for service in gateway.grpc_services:
        service.add_to(server)
    if plan.credentials is None:
        server.add_insecure_port(plan.address)
    else:
        server.add_secure_port(plan.address, plan.credentials)
    await server.start()
    tls = "mutual TLS" if plan.credentials else "plaintext"
    logger.info("gRPC: %s (%s)", plan.address, tls)
    return server


async def stop_grpc(server: aio.Server | None) -> None:
    if server is not None:
        await server.stop(CLOSE_GRACE_S)
