"""The listeners' ports, bound before the engine starts: a port another program holds stops the
start in a moment with one line naming the address and its setting, not after the engine start.

A single server binds each HTTP port exclusively (uvicorn then serves on the socket) and the gRPC
port through grpc itself; with `workers` > 1 the supervisor checks and reserves every port
(server/runtime/workers.py) and each worker joins it with SO_REUSEPORT.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable

BACKLOG = 2048
SETTINGS = {
    "data": "ServerConfig.port",
    "management": "ServerConfig.managementPort",
    "metrics": "ServerConfig.metricsPort",
    "grpc": "ServerConfig.grpcPort",
}


class PortUnavailable(Exception):
    """A listener cannot have its address; the message is the one line the start-up logs."""


def unavailable(
    host: str, port: int, roles: Iterable[str], error: OSError | str
) -> PortUnavailable:
    """The error for host:port of the listeners `roles` (names their settings)."""
    settings = " and ".join(SETTINGS[role] for role in roles)
    if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
        why = "is already in use by another process"
    else:
        why = f"cannot be bound ({error.strerror if isinstance(error, OSError) else error})"
    return PortUnavailable(
        f"{settings}: {host}:{port} {why}; not starting (free the port or set another)"
    )


def bind_port(
    host: str, port: int, roles: Iterable[str], *, listen: bool, shared: bool = False
) -> socket.socket:
    """A TCP socket bound to host:port, listening or not; PortUnavailable if it cannot be.
    `shared`: with SO_REUSEPORT (a worker's socket, or the supervisor's reservation of a port:
    the kernel hands connections to listening sockets only)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise unavailable(host, port, roles, exc) from None
    return sock


def check_free(host: str, port: int, roles: Iterable[str]) -> None:
    """PortUnavailable if a program listens on host:port. The probe binds without SO_REUSEPORT:
    a socket with it would silently join another server's workers on the port (same user)."""
    bind_port(host, port, roles, listen=False).close()
