"""The supervisor of `ServerConfig.workers` > 1 front-end processes over one engine core.

It checks and reserves the listeners' ports before anything starts (a taken port stops the start
there; each worker then listens on its own socket of each port with SO_REUSEPORT, HTTP and gRPC
alike, and the kernel spreads connections over them), starts the engine core once through vLLM's
own multi-API-server launch (`CoreLaunch`, the mechanism behind `vllm serve --api-server-count`)
and spawns the workers, each with its own client of that core. It holds no request and never
generates.

One lifecycle: the workers turn ready together (a start barrier); SIGTERM or SIGINT here, or
GET /stopService on any worker (which signals SIGUSR1 here), drains every worker (a SIGTERM to
each); a second SIGTERM/SIGINT here, or GET /stopService?mode=Force on any worker (SIGUSR2
here), forces every worker (FORCE_SIGNAL to each); a worker or an engine process that dies
takes the whole server down cleanly (the others drain, exit code 1), as vLLM's own API-server
manager does: a worker holds its engine-core sockets, which a replacement could not take over,
and an orchestrator restarts the server as a whole.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from server.core.lifecycle import log_phase
from server.engines.factory import launch_core
from server.runtime.grpc_listener import plan_grpc
from server.runtime.listeners import plan_listeners, uvicorn_config
from server.runtime.ports import PortUnavailable, bind_port, check_free
from server.runtime.process import FORCE_SIGNAL, run_worker
from server.runtime.worker import Worker
from server.settings import Settings

if TYPE_CHECKING:
    from server.engines.vllm_launch import ClientPlace, CoreLaunch

logger = logging.getLogger("gateway")
EXIT_GRACE_S = 10.0  # after the drain timeout, how long workers get to exit before SIGKILL
DRAIN, FORCE = 1, 2  # the stop levels relayed to the workers
_RELAYED_AS = {DRAIN: signal.SIGTERM, FORCE: FORCE_SIGNAL}


async def _refuse(scope: Any, receive: Any, send: Any) -> None:
    """A placeholder app: the supervisor builds listener configs only to check them."""


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.count = settings.server.workers
        self._context = multiprocessing.get_context("spawn")
        self._private = Path(tempfile.mkdtemp(prefix="llm-gateway-"))  # mode 0700
        self._stops = 0  # SIGTERM/SIGINT received; a second one forces
        self._stop_asked = False  # any stop (signal or a worker's /stopService)
        self._relayed = 0  # stop signals relayed to the workers
        self._failed = False
        self.workers: list[BaseProcess] = []
        self._launch: CoreLaunch | None = None
        self._barrier: Any = None
        self._reaped: set[int] = set()

    def run(self, started: float) -> int:
        """Start everything, supervise until stopped, clean up. The process exit code."""
        try:
            reserved = self._reserve()
        except PortUnavailable as exc:
            logger.error("%s", exc)  # the one line: before the engine, no traceback
            shutil.rmtree(self._private, ignore_errors=True)
            return 1
        log_phase(logger, "listeners", started, "ports reserved for the workers")
        self._install_signals()
        # the workers inherit it; prometheus_client reads it when they import it
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self._metrics_dir())  # noqa: TID251
        try:
            self._start([sock.getsockname()[1] for sock in reserved])
        except Exception:
            logger.exception("the server failed to start")
            self._failed = True
            self._stop_asked = True
        try:
            self._supervise()
        finally:
            self._clean_up()
            for sock in reserved:
                sock.close()
        return 1 if self._failed else 0

    # ---- start ---------------------------------------------------------------------------
    def _reserve(self) -> list[socket.socket]:
        """Check every listener as a single server would (TLS files, bind address), then every
        port (PortUnavailable if a program listens there), then reserve them all: the HTTP
        ports in `plan_listeners` order, the gRPC port last (port 0 gets its number)."""
        settings = self.settings
        listeners = plan_listeners(settings)
        for listener in listeners:
            uvicorn_config(_refuse, listener, settings)
        wanted = [(ln.host, ln.port, ln.roles) for ln in listeners]
        grpc = plan_grpc(settings)
        if grpc is not None:
            wanted.append((grpc.host, grpc.port, ("grpc",)))
        for host, port, roles in wanted:
            check_free(host, port, roles)
        reserved: list[socket.socket] = []
        try:
            for host, port, roles in wanted:
                reserved.append(bind_port(host, port, roles, listen=False, shared=True))
        except PortUnavailable:
            for sock in reserved:
                sock.close()
            raise
        return reserved

    def _metrics_dir(self) -> Path:
        path = self._private / "metrics"
        path.mkdir()
        return path

    def _start(self, ports: list[int]) -> None:
        """Start the engine core and the workers on the reserved `ports` (the HTTP listeners',
        then the gRPC one's if configured)."""
        since = time.monotonic()
        self._barrier = self._context.Barrier(self.count)
        role = self._context.RawValue("i", 0)
        self._launch = launch_core(self.settings, self.count)
        if self._launch is None:
            self._spawn(ports, role, [None] * self.count)
        else:
            with self._launch.start() as places:
                self._spawn(ports, role, list(places))
                self._launch.watch(self.workers)
            log_phase(logger, "engine start", since, f"engine core for {self.count} workers")

    def _spawn(self, ports: list[int], role: Any, places: list[ClientPlace | None]) -> None:
        http_count = len(plan_listeners(self.settings))
        grpc_port = ports[http_count] if len(ports) > http_count else None
        for index, place in enumerate(places):
            worker = Worker(
                index=index, count=self.count, supervisor=os.getpid(),
                ports=tuple(ports[:http_count]),
                grpc_port=grpc_port,
                registry_path=self._private / "registry.sock", started=self._barrier,
                role=role, engine=place,
            )
            process = self._context.Process(
                target=run_worker, args=(self.settings, worker), name=worker.name
            )
            process.start()
            self.workers.append(process)

    # ---- signals ---------------------------------------------------------------------------
    def _install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGUSR1, self._on_worker_stop)
        signal.signal(signal.SIGUSR2, self._on_worker_stop)

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stops += 1
        self._stop_asked = True
        what = "forcing the stop" if self._stops > 1 else "draining every worker"
        logger.info("%s: %s", signal.Signals(signum).name, what)

    def _on_worker_stop(self, signum: int, frame: FrameType | None) -> None:
        """SIGUSR1: a worker was asked to stop (/stopService); SIGUSR2: to stop at once."""
        if signum == signal.SIGUSR2:
            if self._stops < FORCE:  # each forced worker reports it too
                logger.info("a worker was asked to stop at once: forcing every worker")
            self._stops = max(self._stops, FORCE)
        elif not self._stop_asked:
            logger.info("a worker was asked to stop: draining every worker")
        self._stop_asked = True

    # ---- supervision -----------------------------------------------------------------------
    def _supervise(self) -> None:
        """Until every worker has exited: relay stops, take the server down when a worker
        or an engine process dies."""
        engine = self._launch.sentinels() if self._launch else []
        while any(p.exitcode is None for p in self.workers):
            self._relay_stops()
            alive = [p.sentinel for p in self.workers if p.exitcode is None]
            ready = wait([*alive, *engine], timeout=0.2)
            self._check_engine(engine, ready)
            self._reap()

    def _relay_stops(self) -> None:
        """Tell every live worker the stop level asked since the last relay: SIGTERM drains,
        FORCE_SIGNAL forces (also straight from no stop: one signal, the level asked)."""
        wanted = 0 if not self._stop_asked else min(max(DRAIN, self._stops), FORCE)
        if wanted > self._relayed:
            self._relayed = wanted
            if self._barrier is not None:
                self._barrier.abort()  # workers still starting give up (a started one is past it)
            for process in self.workers:
                if process.exitcode is None and process.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, _RELAYED_AS[wanted])

    def _check_engine(self, engine: list[int], ready: list[Any]) -> None:
        if engine and any(sentinel in ready for sentinel in engine) and not self._failed:
            logger.error("an engine process died: stopping the server")
            self._fail()

    def _reap(self) -> None:
        from server.observability.metrics import worker_exited

        for process in self.workers:
            pid = process.pid or 0
            if process.exitcode is None or pid in self._reaped:
                continue
            self._reaped.add(pid)
            worker_exited(pid)
            logger.info("%s exited (code %s)", process.name, process.exitcode)
            if process.exitcode != 0 or not self._stop_asked:
                if not self._failed:
                    logger.error("%s exited (code %s): stopping the server", process.name,
                                 process.exitcode)
                self._fail()

    def _fail(self) -> None:
        self._failed = True
        self._stop_asked = True
        self._relay_stops()

    def _clean_up(self) -> None:
        deadline = time.monotonic() + self.settings.limits.drain_timeout_s + EXIT_GRACE_S
        for process in self.workers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                logger.error("%s did not exit: killing it", process.name)
                process.kill()
                process.join()
        if self._launch is not None:
            self._launch.shutdown(timeout=EXIT_GRACE_S)
        shutil.rmtree(self._private, ignore_errors=True)
        logger.info("stopped")


def supervise(settings: Settings, started: float) -> int:
    """Run `settings.server.workers` front ends over one engine core until stopped."""
    return Supervisor(settings).run(started)
