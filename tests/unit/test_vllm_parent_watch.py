"""The engine core's watch on the process that started it (server/engines/vllm_parent_watch.py)."""

from __future__ import annotations

import os
import threading

import pytest

from server.engines import vllm_parent_watch
from server.engines.vllm_parent_watch import install, is_engine_core, watch_parent


@pytest.mark.parametrize(("name", "expected"), [
    ("EngineCore", True), ("EngineCore_DP0", True), ("EngineCore_DP12", True),
    ("MainProcess", False), ("worker-0", False), ("VllmWorker-0", False), ("EngineCoreX", False),
])
def test_only_vllms_engine_core_process_is_watched(name: str, expected: bool) -> None:
    assert is_engine_core(name) is expected


def test_the_watch_stops_the_engine_core_once_its_parent_is_another() -> None:
    stopped: list[bool] = []
    watch_parent(os.getppid() + 1, lambda: stopped.append(True), poll_s=0.01)
    assert stopped == [True]


def test_the_watch_keeps_waiting_while_the_parent_is_alive() -> None:
    stopped: list[bool] = []
    alive = os.getppid()
    watch = threading.Thread(  # polls on until the session ends: a daemon, every 50 ms
        target=watch_parent, args=(alive, lambda: stopped.append(True), 0.05), daemon=True,
    )
    watch.start()
    watch.join(0.2)
    assert watch.is_alive() and stopped == []


def test_outside_the_engine_core_the_plugin_does_nothing() -> None:
    """vLLM loads it in the gateway's own process too, whose parent may go (a shell) while it
    serves on: it must not watch there."""
    threads = threading.active_count()
    install()
    assert threading.active_count() == threads
    assert vllm_parent_watch._watching is False
