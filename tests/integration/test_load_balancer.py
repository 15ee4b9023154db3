"""A real HAProxy (Debian's package, each shipped config as it is: deploy/haproxy.cfg's least
connections, and deploy/haproxy-affinity.cfg's hashing by adapter with the load on adapters a1-a3
and the base model) in front of two gateway replicas on the real engine: a plain rolling restart
(/stopService on one replica, wait for its exit, start it again, then the other; no `state drain`
step on the balancer) under steady mixed-protocol load loses no request and cuts no stream, thanks
to the replicas' lame-duck period (`ServerConfig.drainDelay`, its default: readiness fails at
once, what HAProxy still sends before its health check takes the replica out is served). With
affinity, the stopped replica's adapters move to the other replica (which loads them) and back.
The restarted replicas' logs show each start-up phase once.

Each replica's engine worker is pinned to its own core (`VLLM_CPU_OMP_THREADS_BIND`): see
docs/operations.md, "Replicas on one CPU host", for why a restart under load needs it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest

from tests.integration.traffic import (
    BASE,
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

# each case typically 2-5 minutes: two starts, then two restarts under load, each bounded below
# (on a 2-core host shared with other engines, a start beside the loaded replica took over 3
# minutes)
pytestmark = [pytest.mark.anyio, pytest.mark.engine, pytest.mark.timeout(1800)]
CONFIG = ROOT / "deploy" / "haproxy.cfg"
AFFINITY = ROOT / "deploy" / "haproxy-affinity.cfg"
ADAPTERS = ("a1", "a2", "a3")  # the demo's
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
START_S = 480.0  # one replica's start while the other serves the load, on a busy 2-core host
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
    """CLIENTS clients looping over KINDS through the balancer until stopped, each round of
    KINDS on the next of `models`."""

    http: httpx.AsyncClient
    models: tuple[str, ...]
    outcomes: list[tuple[float, Outcome]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    sent: collections.Counter[str] = field(default_factory=collections.Counter)

    async def client(self, first: int) -> None:
        turn = first
        while not self.stop.is_set():
            kind, sender = KINDS[turn % len(KINDS)]
            model = self.models[turn // len(KINDS) % len(self.models)]
            turn += 1
            self.sent[model] += 1
            outcome = await run_one(self.http, kind, functools.partial(sender, model=model),
                                    TOKENS)
            self.outcomes.append((time.monotonic(), outcome))

    def done_since(self, since: float) -> int:
        return sum(1 for ended, _ in self.outcomes if ended >= since)


async def rolling_restart(
    balancer: Balancer, replicas: dict[str, RunningServer], tmp: Path, load: Load
) -> tuple[list[str], dict[str, int]]:
    """Each replica in turn: /stopService, exit 0, start again, back UP. Returns what went
    wrong (the answer of each step, the stopped replica's refusals, that load flowed meanwhile)
    and how many requests each replica admitted during its lame-duck period."""
    problems, lame_duck = [], {}
    for name, old in list(replicas.items()):
        since = time.monotonic()
        async with async_management_client(old, timeout=STEP_S) as management:
            stop = await management.get("/stopService")
        code = await asyncio.to_thread(old.process.wait, STEP_S)
        (tmp / f"{name}.stopped.log").write_text(old.log())  # the restart replaces it
        served, refused = lame_duck_served(old.log())
        lame_duck[name] = served
        new = start_server(tmp / name, old.config, PINNED[name])
        replicas[name] = new
        await asyncio.to_thread(wait_ready, new, START_S)
        await asyncio.to_thread(wait_for, functools.partial(balancer.up, name), STEP_S, "UP")
        if stop.status_code != 200 or code != 0 or refused or load.done_since(since) < 10:
            problems.append(f"{name}: stop {stop.status_code}, exit {code}, {refused} refused, "
                            f"{load.done_since(since)} answers meanwhile")
    return problems, lame_duck


def lame_duck_served(log: str) -> tuple[int, int]:
    """From a stopped replica's log (its access lines): the requests that arrived during its
    lame-duck period and were answered 200, and the POSTs it answered 503 (refused)."""
    lines = log.splitlines()
    begun = next(_logged_at(line) for line in lines if " lame duck for " in line)
    ended = next(_logged_at(line) for line in lines
                 if " draining " in line and _logged_at(line) >= begun)
    served = refused = 0
    for line in lines:
        access = re.search(r"\] POST \S+ (\d{3}) .* ms=([\d.]+)$", line)
        if access is None:
            continue
        arrived = _logged_at(line) - timedelta(milliseconds=float(access[2]))
        served += access[1] == "200" and begun <= arrived < ended
        refused += access[1] == "503"
    return served, refused


def _logged_at(line: str) -> datetime:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


def start_replicas(tmp: Path) -> dict[str, RunningServer]:
    ensure_assets()
    overrides = {"LimitsConfig": {"drainTimeout": 60}, "LoggingConfig": {"accessLog": True}}
    replicas = {}
    for name, env in PINNED.items():
        config = merge(base_config(), overrides)
        del config["ServerConfig"]["drainDelay"]  # the default lame-duck period
        replicas[name] = start_server(tmp / name, config, env)
    try:
        for replica in replicas.values():
            wait_ready(replica, START_S)
    except BaseException:  # a replica that never turned ready: stop both, leave none behind
        for replica in replicas.values():
            replica.stop()
        raise
    return replicas


@pytest.mark.parametrize(("config", "models"), [
    pytest.param(CONFIG, (BASE,), id="least-connections"),
    pytest.param(AFFINITY, (*ADAPTERS, BASE), id="adapter-affinity"),
])
async def test_rolling_restart_behind_haproxy_loses_no_request(
    tmp_path: Path, config: Path, models: tuple[str, ...]
) -> None:
    started = time.monotonic()
    replicas = start_replicas(tmp_path)
    try:
        with running_balancer(tmp_path, replicas, config) as balancer:
            limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{balancer.port}", timeout=STEP_S, limits=limits
            ) as http:
                load = Load(http, models)
                clients = [asyncio.create_task(load.client(i)) for i in range(CLIENTS)]
                await asyncio.sleep(3)
                problems, lame_duck = await rolling_restart(balancer, replicas, tmp_path, load)
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
    print(f"{config.name}: {len(outcomes)} answers in {time.monotonic() - started:.0f}s, "
          f"{len(failed)} failed; sent per model {dict(load.sent)}; admitted during the "
          f"lame-duck period: {lame_duck}")
    assert problems == []
    assert failed == []
    assert kinds == {kind for kind, _ in KINDS} and len(outcomes) >= 100
    assert set(load.sent) == set(models)
    assert {name: start_up_problems(log) for name, log in logs.items()} == {"r1": [], "r2": []}
