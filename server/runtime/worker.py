"""One front-end process among `ServerConfig.workers` (started by server/runtime/workers.py).

A worker serves every listener on the sockets the supervisor bound, as its own client of the one
engine core (vLLM's multi-API-server launch), with worker 0 owning the adapter registry
(`OwnerWorker`) and the others mirroring it (`MirrorWorker`; server/runtime/worker_link.py).
Both are placements (server/runtime/placement.py): `serve` runs them as it runs a standalone
process. What the workers share beyond the link lives in the supervisor's shared memory: the
start barrier (one readiness: every worker turns ready at the same moment, after worker 0
registered the start-up adapters) and the MindIE role.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.core.adapter_state import SavedAdapter
from server.core.adapters import AdapterRegistry
from server.core.errors import ServiceUnavailable
from server.core.lifecycle import Lifecycle, Role
from server.core.peers import Peers
from server.gateway import Gateway, saved_adapters
from server.runtime.grpc_listener import GrpcPlan, plan_grpc
from server.runtime.listeners import Listener
from server.runtime.placement import Placement, Watch, folder_watch, register_adapters
from server.runtime.ports import bind_port
from server.runtime.worker_link import MirrorRegistry, OwnerLink, RegistryOwner
from server.settings import Settings

if TYPE_CHECKING:
    from server.engines.vllm_launch import ClientPlace

ROLES = tuple(Role)
START_TIMEOUT_S = 900.0  # every worker started (engine clients, adapters) within this


@dataclass(frozen=True, slots=True, kw_only=True)
class Worker:
    """What the supervisor hands a worker process it spawns."""

    index: int
    count: int
    supervisor: int  # its pid: once this process's parent is another, the supervisor is gone
    ports: tuple[int, ...]  # one per listener, in `plan_listeners` order (0 resolved)
    grpc_port: int | None  # the gRPC listener's (0 resolved), None without one
    registry_path: Path  # the owner's Unix socket
    started: threading.Barrier  # a multiprocessing Barrier of `count` parties
    role: Any  # a multiprocessing RawValue("i"): index of the role in ROLES
    engine: ClientPlace | None  # None: the fake engine (one per worker)

    @property
    def name(self) -> str:
        return f"worker-{self.index}"

    def placement(self) -> Placement:
        """Worker 0 owns the adapter registry; the others mirror it."""
        return OwnerWorker(self) if self.index == 0 else MirrorWorker(self)

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


class WorkerPlacement:
    """What every worker does alike: the supervisor's shared role, its stop relay (SIGINT is
    the supervisor's to relay), its reserved ports, its start barrier and the watch on it."""

    handles_interrupt = False
    peers: Peers

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def lifecycle(self) -> Lifecycle:
        return SharedRoleLifecycle(self.worker.role)

    def report_stop(self, force: bool) -> None:
        """The supervisor stops every worker the same way (SIGUSR2: `?mode=Force`). Once it is
        gone, this process's parent is whatever adopted it, which must not be signalled."""
        if os.getppid() == self.worker.supervisor:
            os.kill(self.worker.supervisor, signal.SIGUSR2 if force else signal.SIGUSR1)

    def grpc_plan(self, settings: Settings) -> GrpcPlan | None:
        return plan_grpc(settings, shared=True, port=self.worker.grpc_port)

    def bind(self, listeners: Sequence[Listener]) -> list[socket.socket]:
        """This worker's own socket per listener, sharing the port with the other workers
        (SO_REUSEPORT: the kernel spreads new connections evenly over them; one socket accepted
        by all would let whichever worker wakes first take every waiting connection)."""
        return [bind_port(ln.host, port, ln.roles, listen=True, shared=True)
                for ln, port in zip(listeners, self.worker.ports, strict=True)]

    async def all_started(self) -> None:
        try:
            await asyncio.to_thread(self.worker.started.wait, START_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise ServiceUnavailable("another worker failed to start") from None

    def watches(self, gateway: Gateway) -> list[Watch]:
        return [watch_supervisor(self.worker.supervisor, gateway.shutdown.request)]


class OwnerWorker(WorkerPlacement):
    """Worker 0: registers the start-up adapters and serves its registry to the others."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        self._owner = RegistryOwner(worker.registry_path)
        self.peers = Peers(self._owner.ask_mirrors)

    def saved_adapters(self, settings: Settings) -> list[SavedAdapter]:
        return saved_adapters(settings)

    def make_adapters(self, **parts: Any) -> AdapterRegistry:
        return AdapterRegistry(on_change=self._owner.publish, **parts)

    async def start_adapters(self, gateway: Gateway, saved: list[SavedAdapter]) -> None:
        await self._owner.start(gateway.adapters, self.peers)
        await register_adapters(gateway, saved)

    def watches(self, gateway: Gateway) -> list[Watch]:
        return [*super().watches(gateway), *folder_watch(gateway)]

    async def leave(self, timeout_s: float) -> None:
        """Serve until every mirror has left (their requests still acquire and release adapters
        while they drain)."""
        await self._owner.wait_mirrors_gone(timeout_s)
        await self._owner.close()


class MirrorWorker(WorkerPlacement):
    """Workers 1..N-1: take the owner's adapters and send it every change."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        self._link = OwnerLink(worker.registry_path)
        self.peers = Peers(self._link.ask_owner)

    def saved_adapters(self, settings: Settings) -> list[SavedAdapter]:
        return []  # the owner registers them

    def make_adapters(self, **parts: Any) -> AdapterRegistry:
        return MirrorRegistry(link=self._link, **parts)

    async def start_adapters(self, gateway: Gateway, saved: list[SavedAdapter]) -> None:
        await self._link.connect(gateway.adapters.show, self.peers)

    async def leave(self, timeout_s: float) -> None:
        await self._link.close()


async def watch_supervisor(supervisor: int, stop: Callable[[], None]) -> None:
    """Stop if the supervisor is gone (killed): a worker never serves on its own. It may have
    gone before this watch starts (while this worker was still starting), so the pid to compare
    with is the one the supervisor handed over, not the parent found now."""
    while os.getppid() == supervisor:  # noqa: ASYNC110 (no event tells a parent's death)
        await asyncio.sleep(1.0)
    logging.getLogger("gateway").error("the supervisor is gone: stopping")
    stop()


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
