"""One front-end process among `ServerConfig.workers` (started by server/runtime/workers.py).

A worker serves every listener on the sockets the supervisor bound, as its own client of the one
engine core (vLLM's multi-API-server launch), with worker 0 owning the adapter registry and the
others mirroring it (server.runtime.worker_link.py). What the workers share beyond that lives in
the supervisor's shared memory: the start barrier (one readiness: every worker turns ready at the
same moment, after worker 0 registered the start-up adapters) and the MindIE role.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.core.adapters import AdapterRegistry
from server.core.errors import ServiceUnavailable
from server.core.lifecycle import Lifecycle, Role
from server.runtime.ports import bind_port
from server.runtime.worker_link import mirror_factory

if TYPE_CHECKING:
    from server.engines.vllm_launch import ClientPlace
    from server.runtime.process import Listener
    from server.settings import Settings

ROLES = tuple(Role)
START_TIMEOUT_S = 900.0  # every worker started (engine clients, adapters) within this


@dataclass(frozen=True, slots=True, kw_only=True)
class Worker:
    index: int
    count: int
    ports: tuple[int, ...]  # one per listener, in `plan_listeners` order (0 resolved)
    grpc_port: int | None  # the gRPC listener's (0 resolved), None without one
    registry_path: Path  # the owner's Unix socket
    started: threading.Barrier  # a multiprocessing Barrier of `count` parties
    role: Any  # a multiprocessing RawValue("i"): index of the role in ROLES
    engine: ClientPlace | None  # None: the fake engine (one per worker)

    def listening_sockets(self, listeners: Sequence[Listener]) -> list[socket.socket]:
        """This worker's own socket per listener, sharing the port with the other workers
        (SO_REUSEPORT: the kernel spreads new connections evenly over them; one socket accepted
        by all would let whichever worker wakes first take every waiting connection)."""
        return [bind_port(ln.host, port, ln.roles, listen=True, shared=True)
                for ln, port in zip(listeners, self.ports, strict=True)]

    @property
    def owner(self) -> bool:
        return self.index == 0

    @property
    def name(self) -> str:
        return f"worker-{self.index}"

    def share(self, settings: Settings) -> Settings:
        """This worker's part of the server-wide limits (connections, admitted and queued
        requests), so that the configured numbers stay the server's."""
        limits, server = settings.limits, settings.server
        return settings.model_copy(update={
            "limits": limits.model_copy(update={
                "max_concurrent_requests": _part(limits.max_concurrent_requests, self.count),
                "max_queue": _part(limits.max_queue, self.count),
            }),
            "server": server.model_copy(update={
                "max_links": _part(server.max_links, self.count),
            }),
        })

    def lifecycle(self) -> Lifecycle:
        return SharedRoleLifecycle(self.role)

    def make_adapters(self) -> Callable[..., AdapterRegistry]:
        return AdapterRegistry if self.owner else mirror_factory(self.registry_path)

    def tell_supervisor(self, force: bool) -> None:
        """A stop was requested here (GET /stopService, `?mode=Force`): the supervisor stops
        every worker the same way."""
        os.kill(os.getppid(), signal.SIGUSR2 if force else signal.SIGUSR1)

    async def watch_supervisor(self, stop: Callable[[], None]) -> None:
        """Stop if the supervisor is gone (killed): a worker never serves on its own."""
        parent = os.getppid()
        while os.getppid() == parent:  # noqa: ASYNC110 (no event tells a parent's death)
            await asyncio.sleep(1.0)
        logging.getLogger("gateway").error("the supervisor is gone: stopping")
        stop()

    async def all_started(self) -> None:
        """Return when every worker has started; ServiceUnavailable if one failed to."""
        try:
            await asyncio.to_thread(self.started.wait, START_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise ServiceUnavailable("another worker failed to start") from None


class SharedRoleLifecycle(Lifecycle):
    """A lifecycle whose role is the supervisor's shared one: a role set on any worker is
    every worker's."""

    def __init__(self, shared: Any) -> None:
        self._shared = shared
        super().__init__()

    @property
    def role(self) -> Role:
        index: int = self._shared.value
        return ROLES[index]

    @role.setter
    def role(self, role: Role) -> None:
        self._shared.value = ROLES.index(role)


def _part(total: int, count: int) -> int:
    """`total` split over `count` workers, rounded up (0 stays 0: "none")."""
    return -(-total // count)


def run_worker(settings: Settings, worker: Worker) -> None:
    """The entry point of a spawned worker process."""
    import uvloop

    from server.engines.factory import create_engine
    from server.observability.logs import configure_logging
    from server.runtime.process import serve

    configure_logging(
        settings.logging.level, json_format=settings.logging.json_format, process=worker.name
    )
    logging.getLogger("gateway").info("%s pid %d", worker.name, os.getpid())
    factory = partial(create_engine, client=worker.engine)
    sys.exit(uvloop.run(serve(worker.share(settings), factory, worker=worker)))
