"""Scenario H: adapter affinity at the balancer. A real HAProxy (Debian's package) in front of two
gateway replicas on the real engine, each with `maxLoras` 2 and 8 cached adapters
(`maxCpuLoras`), serving 16 adapters requested in a random order (copies of the demo adapter,
as scenario C makes them): deploy/haproxy-affinity.cfg as shipped (consistent hash on the
adapter, bounded load) vs the same file with `balance roundrobin`, one HAProxy per window, the
replicas kept, the arms alternating which goes first each round. Each window is preceded by an
untimed warm-up of the same mix, so it starts from the arm's own steady state; the replicas'
cold loads (loads a request waited for, `gateway_adapter_cold_loads_total`) are counted over
the timed part. Each replica's engine worker is pinned to its own core, as the load-balancer
test does.

Not part of `python -m bench all` (its replicas and rounds would take the budget): run it with
`python -m bench h`.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import httpx
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from bench.http import Target
from bench.load import Workload, warm_up
from bench.prompts import prompt_set
from bench.record import RESULTS, Run
from bench.scenarios import Plan, _engine_note, lora_copies, rotated, session
from bench.servers import DEMO, EngineSettings, Server, free_port, start_gateway
from bench.wrk import _apt_install

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "haproxy-affinity.cfg"
ARMS = ("affinity", "round-robin")
HASH = "balance hash var(txn.adapter)"
LABEL = "16-adapters"
UP_S = 60.0
MIX = 1024  # the random sequence of adapters requests follow
WARM_UP = 48  # untimed requests before each window
READY_S = 600.0  # one replica start, on a shared and busy machine


def run_h(run: Run, plan: Plan) -> None:
    haproxy = _haproxy()
    if haproxy is None:
        return
    folder = RESULTS / "adapters-h"
    names = tuple(lora_copies(plan.h_adapters, DEMO / "adapters" / "a1", folder, "h"))
    engine = EngineSettings(max_loras=2, max_cpu_loras=8, adapter_dir=str(folder))
    version = subprocess.run([haproxy, "-v"], capture_output=True, text=True, check=False)
    run.note(
        "engine", scenario="H", **_engine_note(engine), replicas=2,
        haproxy=version.stdout.split(" - ")[0].strip(),
    )  # fmt: skip
    prompts = prompt_set(32, 64, engine.model)
    # adapters in a random (seeded) order: a fixed cycle would pair each adapter with one
    # replica under round robin too (request i to replica i % 2), an affinity by accident
    order = random.Random(0)
    models = tuple(order.choice(names) for _ in range(MIX))
    workload = Workload(
        protocol="openai-completions", stream=True, max_tokens=16, prompts=prompts,
        models=models, concurrency=plan.h_concurrency, requests=plan.h_requests, prompt_len=32,
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        replicas = _replicas(run, engine, stack)
        for rnd in range(plan.h_rounds):
            for position, arm in enumerate(rotated(ARMS, rnd)):
                with balancer(run, haproxy, arm, rnd, replicas) as front:
                    _window(run, front, replicas, workload, arm, rnd, first=position == 0)


def _window(
    run: Run, front: Server, replicas: list[Server], workload: Workload, arm: str, rnd: int,
    *, first: bool,
) -> None:
    target = Target.parse(front.url, None)
    uvloop.run(warm_up(target, workload, WARM_UP))
    before = [_counters(r) for r in replicas]
    row = run.window("H", arm, front, workload, LABEL, round=rnd, first=first)
    after = [_counters(r) for r in replicas]
    moved = [{k: a[k] - b.get(k, 0.0) for k in a} for a, b in zip(after, before, strict=True)]
    run.note(
        "affinity", scenario="H", arm=arm, round=rnd, window=row["id"],
        cold_loads=sum(m["cold_loads"] for m in moved),
        loads=sum(m["loads"] for m in moved),
        requests_per_replica=[m["requests"] for m in moved],
    )  # fmt: skip
    print(f"    {arm}: cold loads {sum(m['cold_loads'] for m in moved):.0f}", flush=True)


def _replicas(run: Run, engine: EngineSettings, stack: contextlib.ExitStack) -> list[Server]:
    """Both replicas, started at once (a start takes minutes on a busy machine), each in a
    session of `stack` once ready, so whatever started is stopped."""
    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(_replica, run, engine, core) for core in (0, 1)]
        wait(starting)
    for future in starting:
        if future.exception() is None:
            stack.enter_context(session(future.result(), run, "H", "replica"))
    return [future.result() for future in starting]


def _replica(run: Run, engine: EngineSettings, core: int) -> Server:
    name = f"H-r{core + 1}"
    print(f"  starting {name} ...", flush=True)
    env = {**engine.env(), "VLLM_CPU_OMP_THREADS_BIND": str(core)}
    return start_gateway(name, run.logs, engine_settings=engine, env=env, ready_s=READY_S)


def _counters(replica: Server) -> dict[str, float]:
    """The replica's adapter totals: requests, loads, cold loads (every adapter)."""
    text = httpx.get(f"{replica.metrics_url}/metrics", timeout=30).text
    wanted = {
        "gateway_adapter_requests_total": "requests",
        "gateway_adapter_loads_total": "loads",
        "gateway_adapter_cold_loads_total": "cold_loads",
    }
    totals = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                totals[wanted[sample.name]] += sample.value
    return totals


def arm_config(arm: str, port: int, admin: Path, replicas: list[Server]) -> str:
    """deploy/haproxy-affinity.cfg with this run's addresses; round robin for the other arm."""
    text = CONFIG.read_text()
    assert HASH in text, f"{CONFIG} no longer balances with `{HASH}`"
    if arm == "round-robin":
        text = text.replace(HASH, "balance roundrobin")
    text = text.replace("/run/haproxy/admin.sock", str(admin))
    text = text.replace("bind 127.0.0.1:8080", f"bind 127.0.0.1:{port}")
    text = text.replace("server r1 127.0.0.1:1025", f"server r1 {_address(replicas[0])}")
    return text.replace("server r2 127.0.0.1:2025", f"server r2 {_address(replicas[1])}")


def _address(server: Server) -> str:
    return server.url.removeprefix("http://")


@contextlib.contextmanager
def balancer(
    run: Run, haproxy: str, arm: str, rnd: int, replicas: list[Server]
) -> Iterator[Server]:
    name = f"H-haproxy-{arm}-r{rnd}"
    port = free_port()
    admin = run.logs / f"{name}.sock"
    config = run.logs / f"{name}.cfg"
    config.write_text(arm_config(arm, port, admin, replicas))
    log_path = run.logs / f"{name}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([haproxy, "-db", "-f", str(config)], stdout=log,
                                   stderr=subprocess.STDOUT)
    front = Server(name=name, kind="haproxy", process=process,
                   url=f"http://127.0.0.1:{port}", log_path=log_path)
    try:
        _wait_up(admin)
        yield front
    finally:
        process.terminate()
        process.wait(10)


def _wait_up(admin: Path) -> None:
    """Until HAProxy's health checks see both replicas UP."""
    deadline = time.monotonic() + UP_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            rows = _command(admin, "show stat").splitlines()
            states = [r.split(",")[17] for r in rows if r.startswith("gateways,r")]
            if states == ["UP", "UP"]:
                return
        time.sleep(0.2)
    raise RuntimeError("HAProxy never saw both replicas UP")


def _command(admin: Path, line: str) -> str:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(admin))
        sock.sendall(line.encode() + b"\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def _haproxy() -> str | None:
    found = shutil.which("haproxy")
    if found is None:
        installed, how = _apt_install("haproxy")
        found = shutil.which("haproxy") if installed else None
        if found is None:
            print(f"  H skipped: {how}", flush=True)
    return found
