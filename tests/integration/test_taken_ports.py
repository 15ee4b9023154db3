"""A taken port stops the start before the engine: the real server process (vLLM engine
configured), one of its four listeners' ports held by another program, alone and with two
workers. The log says it in one line naming the address and the setting; no traceback; the
engine never starts; the exit code is 1.

The port is held the way another gateway's worker holds it (listening, with SO_REUSEPORT): a
socket of the same user with SO_REUSEPORT could otherwise join that port instead of failing.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.serverproc import RunningServer, base_config, ensure_assets, merge, start_server

EXIT_S = 120.0  # the process ends long before: it imports no engine
KEYS = ("port", "managementPort", "metricsPort", "grpcPort")


@pytest.fixture(scope="module", autouse=True)
def assets() -> None:
    ensure_assets()


def held(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def problems(server: RunningServer, code: int, key: str, port: int) -> list[str]:
    """What is wrong with one failed start's exit code and log."""
    log = server.log()
    errors = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
    expected = (f"ServerConfig.{key}: 127.0.0.1:{port} is already in use by another process; "
                "not starting (free the port or set another)")
    found = []
    if code != 1:
        found.append(f"exit code {code}")
    if len(errors) != 1 or not errors[0].endswith(expected):
        found.append(f"error lines {errors}")
    if "start-up engine" in log or "start-up listeners" in log:
        found.append("the start went on past the ports")
    return found


def distinct_configs(count: int) -> list[dict[str, Any]]:
    """`count` test configs whose ports are all different (the servers run at once: one
    server must not meet another's port instead of the held one)."""
    while True:
        configs = [base_config() for _ in range(count)]
        ports = [c["ServerConfig"][key] for c in configs for key in KEYS]
        if len(set(ports)) == len(ports):
            return configs


def test_a_taken_port_stops_the_start_before_the_engine(tmp_path: Path) -> None:
    """Every listener, alone and with two workers: the eight servers start at once."""
    cases = [(key, workers) for key in KEYS for workers in (1, 2)]
    configs = distinct_configs(len(cases))
    with contextlib.ExitStack() as holders:
        started = []
        for (key, workers), config in zip(cases, configs, strict=True):
            merge(config, {"ServerConfig": {"workers": workers}})
            port = config["ServerConfig"][key]
            holders.enter_context(held(port))
            server = start_server(tmp_path / f"{key}-{workers}", config)
            started.append((key, workers, port, server))
        found = {
            f"{key}, workers {workers}": problems(server, server.process.wait(EXIT_S), key, port)
            for key, workers, port, server in started
        }
    assert found == {case: [] for case in found}
