"""A worker's stop relay and its watch on the supervisor (server/runtime/worker.py); the
supervisor's relay of a stop to every worker (server/runtime/workers.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from server.core.lifecycle import Lifecycle, Shutdown, State
from server.runtime.process import FORCE_SIGNAL, StopSignals
from server.runtime.worker import Worker, WorkerPlacement, watch_supervisor
from server.runtime.workers import Supervisor
from server.settings import load_settings


def _worker(supervisor: int) -> Worker:
    return Worker(index=1, count=2, supervisor=supervisor, ports=(0,), grpc_port=None,
                  registry_path=Path("unused.sock"), started=threading.Barrier(1), role=None,
                  engine=None)


def _sent(
    monkeypatch: pytest.MonkeyPatch, supervisor: int, *, force: bool
) -> list[tuple[int, int]]:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    WorkerPlacement(_worker(supervisor)).report_stop(force)
    return sent


def test_a_stop_is_relayed_to_the_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    parent = os.getppid()
    assert _sent(monkeypatch, parent, force=False) == [(parent, signal.SIGUSR1)]
    assert _sent(monkeypatch, parent, force=True) == [(parent, signal.SIGUSR2)]


def test_a_process_that_adopted_the_worker_is_never_signalled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _sent(monkeypatch, os.getppid() + 1, force=False) == []


def test_the_watch_stops_at_once_when_the_parent_is_not_the_supervisor() -> None:
    stopped: list[bool] = []
    asyncio.run(asyncio.wait_for(
        watch_supervisor(os.getppid() + 1, lambda: stopped.append(True)), 1.0,
    ))
    assert stopped == [True]


# ---- the supervisor's relay of a stop (server/runtime/workers.py) ----------------------------

@dataclass
class _Process:
    """What the relay reads of a worker process."""

    pid: int
    exitcode: int | None = None


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    made = Supervisor(load_settings(config_path=None, environ={}).settings)
    made.workers = [_Process(101), _Process(102), _Process(103, exitcode=0)]  # type: ignore[list-item]
    yield made
    shutil.rmtree(made._private, ignore_errors=True)


TERM, USR1, USR2 = signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2


@pytest.mark.parametrize(("ticks", "relayed"), [
    ([[USR1]], [TERM]),  # GET /stopService on a worker: every worker drains
    ([[USR2]], [FORCE_SIGNAL]),  # ?mode=Force: every worker forces, with one signal
    ([[USR2], [USR2, USR2], [TERM]], [FORCE_SIGNAL]),  # the forced workers' echoes: no more
    ([[TERM]], [TERM]),
    ([[TERM], [TERM], [TERM]], [TERM, FORCE_SIGNAL]),  # a second SIGTERM forces
    ([[TERM, TERM]], [FORCE_SIGNAL]),  # two within one supervise tick
    ([[USR1], [TERM]], [TERM]),  # one SIGTERM after /stopService still drains, as alone
    ([[USR1], [USR2]], [TERM, FORCE_SIGNAL]),  # a Force during a graceful stop
])
def test_the_supervisor_relays_each_stop_level_once_to_every_live_worker(
    supervisor: Supervisor, monkeypatch: pytest.MonkeyPatch,
    ticks: list[list[signal.Signals]], relayed: list[signal.Signals],
) -> None:
    """Each tick: the signals the supervisor received, then its relay to the workers (103 has
    exited already)."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    handlers = {TERM: supervisor._on_stop_signal, USR1: supervisor._on_worker_stop,
                USR2: supervisor._on_worker_stop}
    for tick in ticks:
        for sig in tick:
            handlers[sig](sig, None)
        supervisor._relay_stops()
    assert sent == [(pid, sig) for sig in relayed for pid in (101, 102)]


def in_a_worker(signals: Callable[[StopSignals, Shutdown], Awaitable[None]]) -> Shutdown:
    """A ready worker's shutdown after `signals` (with its stop signals installed as a worker
    installs them, and removed after)."""
    interrupt = signal.getsignal(signal.SIGINT)

    async def run() -> Shutdown:
        shutdown = Shutdown(Lifecycle(), drain_delay_s=5.0)
        shutdown.lifecycle.ready()
        loop = asyncio.get_running_loop()
        stops = StopSignals(shutdown)
        stops.install(interrupt=False)
        try:
            await signals(stops, shutdown)
        finally:
            for sig in (signal.SIGTERM, FORCE_SIGNAL):
                loop.remove_signal_handler(sig)
            signal.signal(signal.SIGINT, interrupt)
        return shutdown

    return asyncio.run(run())


def test_a_worker_forces_on_its_supervisors_force_signal() -> None:
    """A worker's first signal from its supervisor may be the forced stop: no lame-duck
    period, in-flight requests aborted (`forced`), as a second SIGTERM does."""

    async def forced_by_the_signal(stops: StopSignals, shutdown: Shutdown) -> None:
        os.kill(os.getpid(), FORCE_SIGNAL)
        await asyncio.wait_for(shutdown.forced.wait(), 10.0)

    shutdown = in_a_worker(forced_by_the_signal)
    assert shutdown.requested.is_set()
    assert not shutdown.lifecycle.lame_duck
    assert shutdown.lifecycle.state is State.DRAINING


def test_a_worker_drains_on_every_sigterm() -> None:
    """A SIGTERM to the whole process group reaches a worker from its sender and again from
    its supervisor's relay: two SIGTERMs there still drain; only FORCE_SIGNAL forces."""

    async def two_sigterms(stops: StopSignals, shutdown: Shutdown) -> None:
        stops.handle(signal.SIGTERM)
        stops.handle(signal.SIGTERM)
        await asyncio.sleep(0)

    shutdown = in_a_worker(two_sigterms)
    assert shutdown.requested.is_set() and not shutdown.forced.is_set()
