"""The HTTP listeners: data, management and metrics (those on one address merged), each an
HTTP server without its own signal handling, serving a socket bound before the engine starts:
uvicorn by default, granian with `ServerConfig.httpRunner: "granian"`
(server/runtime/granian_runner.py).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

import uvicorn
from starlette.types import ASGIApp

from server.runtime.limits import (
    CONNECTIONS_PER_LINK,
    HttpLimits,
    limited_protocol,
)
from server.runtime.ports import PortUnavailable, bind_port
from server.runtime.tls import build_context, check_bind_address, tls_files
from server.settings import Settings


@dataclass(frozen=True, slots=True, kw_only=True)
class Listener:
    host: str
    port: int
    roles: tuple[str, ...]
    tls_listener: str  # whose TLS settings apply


def plan_listeners(settings: Settings) -> list[Listener]:
    """Data, management and metrics listeners; those on the same address are merged."""
    server = settings.server
    merged: dict[tuple[str, int], list[str]] = {}
    for role in ("data", "management", "metrics"):
        spec = getattr(server, role)
        merged.setdefault((spec.host, spec.port), []).append(role)
    return [
        Listener(host=host, port=port, roles=tuple(roles), tls_listener=roles[0])
        for (host, port), roles in merged.items()
    ]


class HttpServer(Protocol):
    """What server/runtime/process.py needs of a listener's server."""

    @property
    def started(self) -> bool:
        """True once it accepts connections."""

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve the one bound socket until stopped."""

    def stop(self) -> None:
        """Stop accepting; open requests finish (bounded), then `serve` returns."""


class GatewayServer(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    def stop(self) -> None:
        self.should_exit = True


def build_server(app: ASGIApp, listener: Listener, settings: Settings) -> HttpServer:
    """The listener's server, of the runner `ServerConfig.httpRunner` names."""
    if settings.server.http_runner == "granian":
        from server.runtime.granian_runner import GranianServer

        files = tls_files(settings, listener.tls_listener)
        check_bind_address(settings.server, listener.host, files is not None)
        return GranianServer(
            app, HttpLimits.from_settings(settings.server), files, graceful_stop_s(settings)
        )
    return GatewayServer(uvicorn_config(app, listener, settings))


def graceful_stop_s(settings: Settings) -> float:
    """How long a stopping listener waits for its open connections (after the drain)."""
    return settings.limits.drain_timeout_s + 5


def uvicorn_config(app: ASGIApp, listener: Listener, settings: Settings) -> uvicorn.Config:
    files = tls_files(settings, listener.tls_listener)
    check_bind_address(settings.server, listener.host, files is not None)
    config = uvicorn.Config(
        app,
        host=listener.host,
        port=listener.port,
        loop="uvloop",
        http="httptools",
        ws="none",  # no route speaks WebSocket: refuse upgrades instead of handing them over
        lifespan="off",
        access_log=False,  # server/metrics.py writes the access log, with the request id
        log_config=None,
        timeout_keep_alive=int(settings.server.keep_alive_timeout_s),
        timeout_graceful_shutdown=int(graceful_stop_s(settings)),
        # backstop only: server/runtime/limits.py already caps connections at 3 × maxLinkNum
        limit_concurrency=settings.server.max_links * CONNECTIONS_PER_LINK + 1,
        server_header=False,
    )
    config.load()
    # httptools bounds neither the request head nor its arrival time (RELIABILITY_PERF.md B.4)
    config.http_protocol_class = limited_protocol(HttpLimits.from_settings(settings.server))
    if files is not None:
        config.ssl = build_context(files)
    return config


def bind_listeners(listeners: Sequence[Listener]) -> list[socket.socket]:
    """One listening socket per listener, bound exclusively; PortUnavailable (and none left
    open) if any address is taken."""
    sockets: list[socket.socket] = []
    try:
        for listener in listeners:
            sockets.append(bind_port(listener.host, listener.port, listener.roles, listen=True))
    except PortUnavailable:
        for sock in sockets:
            sock.close()
        raise
    return sockets
