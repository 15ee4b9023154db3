"""A real HAProxy (Debian's package, deploy/haproxy.cfg as shipped) in front of two gateway
replicas on the real engine: a rolling restart under steady mixed-protocol load loses no request
and cuts no stream. The restarted replicas' logs show each start-up phase once.

Each replica's engine worker is pinned to its own core (`VLLM_CPU_OMP_THREADS_BIND`): see
docs/operations.md, "Replicas on one CPU host", for why a restart under load needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.integration.traffic import (
    Outcome,
    Sender,
    async_management_client,
    complete,
    openai_chat_stream,
    openai_completion,
    run_one,
    tgi_generate_stream,
    triton_generate,
)
from tests.serverproc import (
    ROOT,
    RunningServer,
    base_config,
    ensure_assets,
    free_port,
    merge,
    start_server,
    start_up_problems,
    wait_ready,
)
from tests.tools import debian_tool

# typically 2-3 minutes: two starts, then two restarts under load, each bounded below
pytestmark = [pytest.mark.anyio, pytest.mark.engine, pytest.mark.timeout(600)]
CONFIG = ROOT / "deploy" / "haproxy.cfg"
TOKENS = 24
CLIENTS = 6
KINDS: tuple[tuple[str, Sender], ...] = (
    ("openai-chat-stream", openai_chat_stream),
    ("openai-completion", openai_completion),
    ("tgi-generate-stream", tgi_generate_stream),
    ("triton-generate", triton_generate),
)
# one core per replica's engine worker (the hazard: docs/operations.md)
PINNED = {"r1": {"VLLM_CPU_OMP_THREADS_BIND": "0"}, "r2": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}
START_S = 240.0  # one replica's start while the other serves the load, on a busy 2-core host
STEP_S = 60.0  # a drain, an exit, a health-check transition


def haproxy() -> str:
    return debian_tool("haproxy", "haproxy")


@dataclass
class Balancer:
    process: subprocess.Popen[bytes]
    port: int
    admin: Path

    def command(self, line: str) -> str:
        """One runtime-API command on the admin socket; its answer."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(self.admin))
            sock.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def status(self, server: str) -> str:
        """HAProxy's view of a replica: UP, DOWN, DRAIN, MAINT, "UP 1/2", ..."""
        header, *rows = self.command("show stat").splitlines()
        names = header.removeprefix("# ").split(",")
        for row in rows:
            values = dict(zip(names, row.split(","), strict=False))
            if values.get("pxname") == "gateways" and values.get("svname") == server:
                return values["status"]
        raise AssertionError(f"no server {server} in show stat")

    def up(self, server: str) -> bool:
        return self.status(server) == "UP"


@contextlib.contextmanager
def running_balancer(
    tmp: Path, replicas: dict[str, RunningServer], config: Path = CONFIG
) -> Iterator[Balancer]:
    """A shipped HAProxy config (deploy/haproxy.cfg by default) with this test's ports and
    admin socket."""
    port, admin = free_port(), tmp / "admin.sock"
    text = config.read_text()
    text = text.replace("/run/haproxy/admin.sock", str(admin))
    text = text.replace("bind 127.0.0.1:8080", f"bind 127.0.0.1:{port}")
    for name, replica in replicas.items():
        text = re.sub(rf"server {name} 127\.0\.0\.1:\d+", f"server {name} 127.0.0.1:"
                      f"{replica.data_port}", text)
    written = tmp / "haproxy.cfg"
    written.write_text(text)
    with (tmp / "haproxy.log").open("wb") as log:
        process = subprocess.Popen([haproxy(), "-db", "-f", str(written)], stdout=log,
                                   stderr=subprocess.STDOUT)
    balancer = Balancer(process, port, admin)
    try:
        wait_for(lambda: all(balancer.status(n) == "UP" for n in replicas), 30, "both UP")
        yield balancer
    finally:
        process.terminate()
        process.wait(10)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, AssertionError):
            if condition():
                return
        time.sleep(0.1)
    raise AssertionError(f"not {what} after {timeout}s")


@dataclass
class Load:
    """CLIENTS clients looping over KINDS through the balancer until stopped."""

    http: httpx.AsyncClient
    outcomes: list[tuple[float, Outcome]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, first: int) -> None:
        turn = first
        while not self.stop.is_set():
            kind, sender = KINDS[turn % len(KINDS)]
            turn += 1
            outcome = await run_one(self.http, kind, sender, TOKENS)
            self.outcomes.append((time.monotonic(), outcome))

    def done_since(self, since: float) -> int:
        return sum(1 for ended, _ in self.outcomes if ended >= since)


async def rolling_restart(
    balancer: Balancer, replicas: dict[str, RunningServer], tmp: Path, load: Load
) -> list[str]:
    """Each replica in turn: out of rotation, /stopService, exit 0, start again, back UP.
    Returns what went wrong (the answer of each step, and that load flowed meanwhile)."""
    problems = []
    for name, old in list(replicas.items()):
        since = time.monotonic()
        balancer.command(f"set server gateways/{name} state drain")
        async with async_management_client(old, timeout=STEP_S) as management:
            stop = await management.get("/stopService")
        code = await asyncio.to_thread(old.process.wait, STEP_S)
        balancer.command(f"set server gateways/{name} state ready")
        new = start_server(tmp / name, old.config, PINNED[name])
        replicas[name] = new
        await asyncio.to_thread(wait_ready, new, START_S)
        await asyncio.to_thread(wait_for, functools.partial(balancer.up, name), STEP_S, "UP")
        if stop.status_code != 200 or code != 0 or load.done_since(since) < 10:
            problems.append(f"{name}: stop {stop.status_code}, exit {code}, "
                            f"{load.done_since(since)} answers meanwhile")
    return problems


def start_replicas(tmp: Path) -> dict[str, RunningServer]:
    ensure_assets()
    overrides = {"LimitsConfig": {"drainTimeout": 60}, "LoggingConfig": {"accessLog": True}}
    replicas = {
        name: start_server(tmp / name, merge(base_config(), overrides), env)
        for name, env in PINNED.items()
    }
    for replica in replicas.values():
        wait_ready(replica, START_S)
    return replicas


async def test_rolling_restart_behind_haproxy_loses_no_request(tmp_path: Path) -> None:
    started = time.monotonic()
    replicas = start_replicas(tmp_path)
    try:
        with running_balancer(tmp_path, replicas) as balancer:
            limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{balancer.port}", timeout=STEP_S, limits=limits
            ) as http:
                load = Load(http)
                clients = [asyncio.create_task(load.client(i)) for i in range(CLIENTS)]
                await asyncio.sleep(3)
                problems = await rolling_restart(balancer, replicas, tmp_path, load)
                await asyncio.sleep(3)
                load.stop.set()
                await asyncio.wait_for(asyncio.gather(*clients), STEP_S)
        logs = {name: replica.log() for name, replica in replicas.items()}
    finally:
        for replica in replicas.values():
            replica.stop()
    outcomes = [outcome for _, outcome in load.outcomes]
    failed = [p for p in (complete(o, TOKENS) for o in outcomes) if p]
    kinds = {o.kind for o in outcomes}
    print(f"{len(outcomes)} answers in {time.monotonic() - started:.0f}s, {len(failed)} failed")
    assert problems == []
    assert failed == []
    assert kinds == {kind for kind, _ in KINDS} and len(outcomes) >= 100
    assert {name: start_up_problems(log) for name, log in logs.items()} == {"r1": [], "r2": []}
