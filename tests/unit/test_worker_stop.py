"""A worker's stop relay and its watch on the supervisor (server/runtime/worker.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import pytest

from server.runtime.worker import Worker, WorkerPlacement, watch_supervisor


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
