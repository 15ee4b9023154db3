"""Where this process serves: alone (`Standalone`), or as one of `ServerConfig.workers` front
ends under the supervisor (server/runtime/worker.py). `serve` (server/runtime/process.py) runs
the same steps either way and asks its placement for what differs: the lifecycle and who hears
of a stop, SIGINT, the sockets, the gRPC plan, the adapter registry and the peers (both passed
into `build_gateway`, never attached afterwards), the start-up adapters, the all-started
barrier, the background watches, and what to leave after the drain.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol

from server.core.adapter_state import SavedAdapter
from server.core.adapters import AdapterRegistry
from server.core.lifecycle import Lifecycle, log_phase
from server.core.peers import Peers
from server.gateway import Gateway, register_startup_adapters, saved_adapters
from server.runtime.grpc_listener import GrpcPlan, plan_grpc
from server.runtime.listeners import Listener, bind_listeners
from server.settings import Settings

logger = logging.getLogger("gateway")
Watch = Coroutine[Any, Any, None]


class Placement(Protocol):
    @property
    def handles_interrupt(self) -> bool:
        """Whether SIGINT stops this process (a worker's supervisor relays Ctrl+C instead)."""

    @property
    def peers(self) -> Peers:
        """How this process reaches the other workers (nobody when alone)."""

    def lifecycle(self) -> Lifecycle: ...

    def report_stop(self, force: bool) -> None:
        """A stop was requested here (GET /stopService): tell whoever stops the others."""

    def grpc_plan(self, settings: Settings) -> GrpcPlan | None: ...

    def bind(self, listeners: Sequence[Listener]) -> list[socket.socket]:
        """A listening socket per listener; PortUnavailable, with none left open, if one is
        taken."""

    def saved_adapters(self, settings: Settings) -> list[SavedAdapter]:
        """The state file's registrations this process registers at start (read before the
        engine starts)."""

    def make_adapters(self, **parts: Any) -> AdapterRegistry:
        """`build_gateway`'s adapter registry, from its parts."""

    async def start_adapters(self, gateway: Gateway, saved: list[SavedAdapter]) -> None:
        """Register the start-up adapters, or take them from whoever does."""

    async def all_started(self) -> None:
        """Return once every process serving these listeners has started; ServiceUnavailable
        if one failed to."""

    def watches(self, gateway: Gateway) -> list[Watch]:
        """What runs beside the requests until the stop (besides the engine watchdog)."""

    async def leave(self, timeout_s: float) -> None:
        """After the drain: let go of the other processes (at most `timeout_s`)."""


class Standalone:
    """One process, no supervisor: it owns the registry, binds its own sockets exclusively and
    stops on SIGINT too."""

    handles_interrupt = True

    def __init__(self) -> None:
        self.peers = Peers()

    def lifecycle(self) -> Lifecycle:
        return Lifecycle()

    def report_stop(self, force: bool) -> None:
        """Nobody else to stop."""

    def grpc_plan(self, settings: Settings) -> GrpcPlan | None:
        return plan_grpc(settings)

    def bind(self, listeners: Sequence[Listener]) -> list[socket.socket]:
        return bind_listeners(listeners)

    def saved_adapters(self, settings: Settings) -> list[SavedAdapter]:
        return saved_adapters(settings)

    def make_adapters(self, **parts: Any) -> AdapterRegistry:
        return AdapterRegistry(**parts)

    async def start_adapters(self, gateway: Gateway, saved: list[SavedAdapter]) -> None:
        await register_adapters(gateway, saved)

    async def all_started(self) -> None:
        """Alone: started."""

    def watches(self, gateway: Gateway) -> list[Watch]:
        return folder_watch(gateway)

    async def leave(self, timeout_s: float) -> None:
        """Nothing to leave."""


async def register_adapters(gateway: Gateway, saved: list[SavedAdapter]) -> None:
    since = time.monotonic()
    await register_startup_adapters(gateway, saved)
    log_phase(logger, "adapters", since, f"{len(gateway.adapters)} registered")


def folder_watch(gateway: Gateway) -> list[Watch]:
    """adapterDir rescans (LoraConfig.adapterDirRefresh s; 0 = off), by the registry's owner."""
    lora = gateway.settings.lora
    interval = lora.adapter_dir_refresh_s
    if lora.enabled and interval > 0 and gateway.adapters.limits.discovery_dirs:
        return [gateway.adapters.watch_folders(interval)]
    return []
