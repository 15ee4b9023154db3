"""The process: listeners bound first (health says "starting"; a taken port stops the start
before the engine), then the engine, then READY.

One event loop runs one HTTP server per distinct address (uvicorn, or granian when
`ServerConfig.httpRunner` says so); the gateway owns the signals, so
SIGTERM, SIGINT and GET /stopService all take the same drain path (`Shutdown.request`): stop
admitting, let in-flight requests finish (bounded by drainTimeout, then abort them with an
in-band error), shut the engine down, close the listeners, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from server.core.engine import Engine
from server.core.errors import GatewayError, ServiceUnavailable
from server.core.lifecycle import Lifecycle, Shutdown, State, log_phase
from server.gateway import Gateway, build_gateway, starting_answers
from server.http.starting import StartingAnswers
from server.runtime.grpc_listener import (
    BoundGrpc,
    GrpcPlan,
    bind_grpc,
    start_grpc,
    stop_grpc,
)
from server.runtime.limits import check_uvicorn
from server.runtime.listeners import HttpServer, Listener, build_server, plan_listeners
from server.runtime.placement import Placement
from server.runtime.ports import PortUnavailable
from server.runtime.worker import Worker
from server.settings import Settings

logger = logging.getLogger("gateway")
EngineFactory = Callable[[Settings], Coroutine[Any, Any, Engine]]
ABORT_GRACE_S = 5.0  # after aborting on drain timeout, how long aborted requests get to end
# a supervisor forces its workers with this one signal: two SIGTERMs sent at once may reach
# a worker as one (a standard signal already pending is not queued again)
FORCE_SIGNAL = signal.SIGUSR2


class StartingApp:
    """Answers 503 while the engine starts, in the shape of the protocol that owns the path
    (liveness 200 on the live paths: the process is up), then delegates to the listener's app,
    which is set exactly once."""

    def __init__(self, lifecycle: Lifecycle, answers: StartingAnswers) -> None:
        self._lifecycle = lifecycle
        self._answers = answers
        self._app: ASGIApp | None = None

    def serve(self, app: ASGIApp) -> None:
        assert self._app is None, "a listener's app is set once"
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._app is not None:
            await self._app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] in self._answers.live and self._lifecycle.state is State.STARTING:
            await Response(status_code=200)(scope, receive, send)
            return
        answer = self._answers.answer(scope["path"], self._lifecycle.state.value)
        await answer(scope, receive, send)


async def serve(  # noqa: PLR0915 - the start-up sequence, one step per line
    settings: Settings,
    engine_factory: EngineFactory,
    placement: Placement,
    *,
    started: float | None = None,
) -> int:
    """Run until stopped. Returns the process exit code: 0 after a stop, 1 if the engine failed.
    `placement`: alone, or one of the supervisor's workers (server/runtime/placement.py).
    `started` (time.monotonic() at process start) dates the start-up's `ready` line."""
    phase = time.monotonic()
    check_uvicorn()
    lifecycle = placement.lifecycle()
    shutdown = Shutdown(lifecycle, placement.report_stop, drain_delay_s=settings.server.drain_delay)
    listeners = plan_listeners(settings)
    grpc_plan = placement.grpc_plan(settings)
    saved = placement.saved_adapters(settings)
    holders = [StartingApp(lifecycle, starting_answers(ln.roles)) for ln in listeners]
    servers = [build_server(h, ln, settings) for h, ln in zip(holders, listeners, strict=True)]
    try:
        sockets, bound_grpc = _bind(listeners, grpc_plan, placement)
    except PortUnavailable as exc:
        logger.error("%s", exc)  # the one line: before the engine, no traceback
        return 1
    tasks = await _open(servers, listeners, phase, sockets)
    StopSignals(shutdown).install(interrupt=placement.handles_interrupt)
    try:
        engine = await _start_engine(settings, engine_factory, shutdown.requested)
    except Exception as exc:
        await _unbind_grpc(bound_grpc)
        return await _failed_start("engine failed to start", exc, lifecycle, servers, tasks)
    if engine is None:
        await _unbind_grpc(bound_grpc)
        await _close_servers(servers, tasks)
        return 0
    gateway = build_gateway(
        settings, engine, shutdown=shutdown,
        make_adapters=placement.make_adapters, peers=placement.peers,
    )
    try:
        await placement.start_adapters(gateway, saved)
    except GatewayError as exc:
        await engine.shutdown()
        await _unbind_grpc(bound_grpc)
        return await _failed_start("the adapter registry failed", exc, lifecycle, servers, tasks)
    for holder, listener in zip(holders, listeners, strict=True):
        holder.serve(gateway.app(listener.roles))
    try:
        grpc_server = await start_grpc(gateway, bound_grpc)
        await placement.all_started()
    except Exception as exc:
        await engine.shutdown()
        await _unbind_grpc(bound_grpc)
        return await _failed_start("the start failed", exc, lifecycle, servers, tasks)
    # Move the start-up heap (torch, vLLM, tokenizer) out of the collector's reach, as vLLM's
    # own server does: otherwise full collections under load stall the event loop 0.4-0.65 s.
    gc.collect()
    gc.freeze()
    lifecycle.ready()
    log_phase(logger, "ready", phase if started is None else started, "since the process started")
    background = [asyncio.create_task(watch) for watch in
                  (watch_engine(gateway), *placement.watches(gateway))]
    await shutdown.requested.wait()
    await drain(gateway)
    for task in background:
        task.cancel()
    await stop_grpc(grpc_server)
    await _close_servers(servers, tasks)
    await placement.leave(settings.limits.drain_timeout_s + ABORT_GRACE_S)
    await engine.shutdown()
    lifecycle.stopped()
    logger.info("stopped")
    return 1 if lifecycle.state is State.FAILED else 0


def run_worker(settings: Settings, worker: Worker) -> None:
    """The entry point of a worker process the supervisor spawned (server/runtime/workers.py)."""
    import uvloop

    from server.engines.factory import create_engine
    from server.observability.logs import configure_logging

    configure_logging(
        settings.logging.level, json_format=settings.logging.json_format, process=worker.name
    )
    logger.info("%s pid %d", worker.name, os.getpid())
    factory = partial(create_engine, client=worker.engine)
    sys.exit(uvloop.run(serve(worker.share(settings), factory, worker.placement())))


class StopSignals:
    """SIGTERM and SIGINT: the first one drains (as GET /stopService does), a second forces.
    A worker drains on every SIGTERM and forces on FORCE_SIGNAL alone, its supervisor's relay
    of a forced stop: a SIGTERM sent to the whole process group (systemd's default) reaches a
    worker once from its sender and once relayed, which is still a drain."""

    def __init__(self, shutdown: Shutdown) -> None:
        self._shutdown = shutdown
        self._received = 0
        self._counted = True  # a second SIGTERM forces (not in a worker)

    def install(self, *, interrupt: bool = True) -> None:
        """`interrupt=False` (a worker): SIGINT is ignored, the supervisor relays Ctrl+C, and
        FORCE_SIGNAL forces."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            if sig is signal.SIGINT and not interrupt:
                signal.signal(sig, signal.SIG_IGN)
                continue
            loop.add_signal_handler(sig, self.handle, sig)
        if not interrupt:
            self._counted = False
            loop.add_signal_handler(FORCE_SIGNAL, self.force, FORCE_SIGNAL)

    def handle(self, sig: signal.Signals) -> None:
        self._received += 1
        force = self._counted and self._received > 1
        logger.info("%s: %s", sig.name, "forcing the stop" if force else "draining")
        self._shutdown.request(force=force)

    def force(self, sig: signal.Signals) -> None:
        logger.info("%s: forcing the stop", sig.name)
        self._shutdown.request(force=True)


async def drain(gateway: Gateway) -> None:
    """Serve on through the lame-duck period (drainDelay) if one began; stop admitting; wait
    for in-flight requests (queued ones included) up to drainTimeout, or not at all when
    forced; abort the rest with an in-band error; then set `drained`."""
    lifecycle = gateway.lifecycle
    lifecycle.begin_drain()
    await _lame_duck(gateway)
    lifecycle.end_lame_duck()
    timeout = gateway.settings.limits.drain_timeout_s
    logger.info("draining %d requests (timeout %ss)", lifecycle.inflight, timeout)
    if not await _idle_unless_forced(gateway, timeout):
        aborted = gateway.service.abort_all(ServiceUnavailable("The server is shutting down."))
        logger.warning("drain ended before idle: aborted %d requests", aborted)
        await lifecycle.wait_idle(ABORT_GRACE_S)
    gateway.shutdown.drained.set()


async def _lame_duck(gateway: Gateway) -> None:
    """Readiness fails already, so balancers and Kubernetes take this server out of rotation
    within their check interval; what they still send meanwhile is served, not refused. A
    forced stop ends the period."""
    if not gateway.lifecycle.lame_duck:
        return
    delay = gateway.shutdown.drain_delay_s
    logger.info("lame duck for %ss: readiness fails, new requests are still served", delay)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(gateway.shutdown.forced.wait(), delay)


async def _idle_unless_forced(gateway: Gateway, timeout: float) -> bool:
    """True once nothing is in flight; False on timeout or when a forced stop arrives."""
    idle = asyncio.create_task(gateway.lifecycle.wait_idle(timeout))
    forced = asyncio.create_task(gateway.shutdown.forced.wait())
    done, pending = await asyncio.wait({idle, forced}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return idle in done and idle.result() and not forced.done()


async def watch_engine(gateway: Gateway) -> None:
    """Poll the engine; once it is dead the lifecycle is FAILED: health turns 500, new
    requests 503. Failure is final (vLLM cannot restart its engine in-process)."""
    interval = gateway.settings.limits.engine_check_interval_s
    lifecycle = gateway.lifecycle
    while interval > 0 and lifecycle.state in (State.READY, State.DRAINING):
        await asyncio.sleep(interval)
        try:
            await gateway.engine.check_health()
        except GatewayError as exc:
            logger.error("engine failed its health check: %s", exc.message)
            lifecycle.fail(exc.message)


async def _start_engine(
    settings: Settings, engine_factory: EngineFactory, stop: asyncio.Event
) -> Engine | None:
    start = asyncio.create_task(engine_factory(settings))
    stopped = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if start in done:
        stopped.cancel()
        engine: Engine = start.result()
        return engine
    start.cancel()
    return None


async def _failed_start(
    what: str,
    exc: Exception,
    lifecycle: Lifecycle,
    servers: list[HttpServer],
    tasks: list[asyncio.Task[None]],
) -> int:
    logger.error("%s", what, exc_info=exc)
    lifecycle.fail(str(exc))
    await _close_servers(servers, tasks)
    return 1


def _bind(
    listeners: list[Listener], grpc_plan: GrpcPlan | None, placement: Placement
) -> tuple[list[socket.socket], BoundGrpc | None]:
    """Every listener's port, bound as the placement binds them (a worker's sockets join its
    supervisor's reservation); PortUnavailable, with none left open, if one cannot be."""
    sockets = placement.bind(listeners)
    try:
        return sockets, bind_grpc(grpc_plan)
    except PortUnavailable:
        for sock in sockets:
            sock.close()
        raise


async def _unbind_grpc(bound: BoundGrpc | None) -> None:
    if bound is not None:
        await bound.server.stop(None)


async def _open(
    servers: list[HttpServer],
    listeners: list[Listener],
    since: float,
    sockets: Sequence[socket.socket],
) -> list[asyncio.Task[None]]:
    """Serve the listeners on their bound `sockets` (one per listener); once all serve (or one
    failed, which shows later), log them."""
    tasks = [
        asyncio.create_task(s.serve(sockets=[sock]))
        for s, sock in zip(servers, sockets, strict=True)
    ]
    while not all(s.started for s in servers) and not any(t.done() for t in tasks):  # noqa: ASYNC110 (uvicorn offers only a flag)
        await asyncio.sleep(0.01)
    where = ", ".join(f"{ln.host}:{ln.port} {'+'.join(ln.roles)}" for ln in listeners)
    log_phase(logger, "listeners", since, where)
    return tasks


async def _close_servers(servers: list[HttpServer], tasks: list[asyncio.Task[None]]) -> None:
    for server in servers:
        server.stop()
    await asyncio.gather(*tasks, return_exceptions=True)
