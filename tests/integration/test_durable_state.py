"""Acknowledged adapter changes are durable (`LoraConfig.stateFile`), on the real engine.

The state file lives on a small tmpfs mounted for this module, remounted read-only to stand for
a broken disk (chmod does not stop root). With it read-only, a registration, an update and an
unregistration are refused in each route's shape (DJL, SageMaker, vLLM), every list is as
before, and the engine keeps serving. The server is then killed (SIGKILL) in the middle of a
thousand concurrent registrations and started again, with two workers: every registration that
was answered 200 is back, nothing that was refused or never sent is, and a refusal on a
read-only disk is refused on both workers and changes neither worker's view.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.traffic import async_management_client, management_client
from tests.serverproc import (
    DEMO,
    RunningServer,
    base_config,
    ensure_assets,
    merge,
    start_server,
    wait_ready,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]  # two full starts, one of two workers

SRC = str(DEMO / "adapters" / "a1")
BURST = 1000  # registrations sent when the server is killed
KILL_AFTER = 400  # acknowledged registrations before the kill
READY_S = 480.0


def mount(where: Path, *options: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=8m", *options)), "tmpfs",
                    str(where)], check=True, capture_output=True)


def remount(where: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(where)], check=True,
                   capture_output=True)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    where = tmp_path_factory.mktemp("durable") / "state"
    where.mkdir()
    try:
        mount(where)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"a tmpfs cannot be mounted here (needs root and CAP_SYS_ADMIN): {exc}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture(scope="module")
def run(state_dir: Path) -> dict[str, Any]:
    """What the tests of this module pass on: the config, the acknowledged registrations."""
    ensure_assets()
    config = merge(base_config(), {
        "LoraConfig": {"stateFile": str(state_dir / "adapters.json")},
        "LoggingConfig": {"accessLog": True},  # which worker answered what
    })
    return {"config": config, "dir": state_dir.parent, "acked": set(), "sent": set()}


@pytest.fixture(scope="module")
def first(run: dict[str, Any]) -> Iterator[RunningServer]:
    server = start_server(run["dir"] / "run1", run["config"])
    try:
        wait_ready(server, READY_S)
        yield server
    finally:
        kill_tree(server)


def kill_tree(server: RunningServer) -> None:
    """SIGKILL the server and the engine processes it started."""
    children = _children(server.process.pid)
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait(30)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True, check=False).stdout
    pids = [int(p) for p in out.split()]
    return pids + [grand for child in pids for grand in _children(child)]


def names(server: RunningServer, http: httpx.Client | None = None) -> set[str]:
    """Every model name the server lists (base, folder adapters, registrations)."""
    client = http or httpx.Client(base_url=server.url, timeout=60)
    response = client.get(f"{server.url}/v1/models")
    assert response.status_code == 200, response.text
    return {m["id"] for m in response.json()["data"]}


def describe(mgmt: httpx.Client, name: str) -> dict[str, Any]:
    response = mgmt.get(f"/models/tiny/adapters/{name}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def generates(server: RunningServer, model: str) -> None:
    body = {"model": model, "prompt": "durable", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


def assert_djl_refusal(response: httpx.Response) -> None:
    assert response.status_code == 507, response.text
    body = response.json()
    assert body["code"] == 507 and body["type"] == "InternalServerException"
    assert "read-only file system" in body["message"] and "nothing was changed" in body["message"]


def assert_vllm_refusal(response: httpx.Response) -> None:
    assert response.status_code == 507, response.text
    error = response.json()["error"]
    assert error["code"] == 507 and error["type"] == "InsufficientStorage"
    assert "read-only file system" in error["message"]


def refused_everywhere(server: RunningServer, attempts: int = 1) -> None:
    """A registration, an update and an unregistration on a read-only disk, in each route's
    shape, `attempts` times each (over fresh connections: every worker gets some)."""
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    with management_client(server, timeout=60, limits=no_reuse) as mgmt, httpx.Client(
        base_url=server.url, timeout=60, limits=no_reuse
    ) as http:
        for attempt in range(attempts):
            name = f"refused-{attempt}"
            assert_djl_refusal(mgmt.post("/models/tiny/adapters", params={
                "name": name, "src": SRC}))
            assert_djl_refusal(mgmt.post("/adapters", json={"name": name, "src": SRC},
                                         headers={"Accept": "application/json"}))
            assert_djl_refusal(mgmt.post("/models/tiny/adapters/kept/update",
                                         params={"pin": "true"}))
            assert_djl_refusal(mgmt.delete("/models/tiny/adapters/kept"))
            assert_djl_refusal(mgmt.delete("/adapters/kept"))
            assert_vllm_refusal(http.post("/v1/load_lora_adapter", json={
                "lora_name": name, "lora_path": SRC}))
            assert_vllm_refusal(http.post("/v1/unload_lora_adapter", json={
                "lora_name": "by-vllm"}))


def test_refused_changes_answer_in_each_shape_and_change_nothing(
    first: RunningServer, run: dict[str, Any], state_dir: Path
) -> None:
    with management_client(first, timeout=60) as mgmt:
        ok = mgmt.post("/models/tiny/adapters", params={"name": "kept", "src": SRC})
        assert ok.status_code == 200, ok.text
    ok = httpx.post(f"{first.url}/v1/load_lora_adapter", timeout=60,
                    json={"lora_name": "by-vllm", "lora_path": SRC})
    assert ok.status_code == 200, ok.text
    before = names(first)
    assert {"kept", "by-vllm"} <= before
    remount(state_dir, "ro")
    try:
        refused_everywhere(first)
        with management_client(first, timeout=60) as mgmt:
            assert describe(mgmt, "kept")["pin"] is False
        assert names(first) == before
        generates(first, "kept")
    finally:
        remount(state_dir, "rw")
    run["acked"] |= {"kept", "by-vllm"}


async def burst(server: RunningServer, run: dict[str, Any]) -> None:
    """Register BURST adapters 16 at a time; SIGKILL the server once KILL_AFTER answered."""
    gate = asyncio.Semaphore(16)
    killed = asyncio.Event()

    async def one(http: httpx.AsyncClient, name: str) -> None:
        async with gate:
            if killed.is_set():
                return
            run["sent"].add(name)
            try:
                response = await http.post("/models/tiny/adapters", params={
                    "name": name, "src": SRC, "preload": "false"})
            except httpx.HTTPError:
                return  # in flight when the server died: may or may not be registered
            if response.status_code == 200:
                run["acked"].add(name)
            if len(run["acked"]) >= KILL_AFTER and not killed.is_set():
                killed.set()
                kill_tree(server)

    async with async_management_client(server, timeout=60) as http:
        await asyncio.gather(*(one(http, f"burst-{i:04d}") for i in range(BURST)))


def test_a_sigkill_during_a_thousand_registrations(
    first: RunningServer, run: dict[str, Any]
) -> None:
    asyncio.run(burst(first, run))
    assert first.process.poll() is not None  # killed in the middle, not after the burst
    assert KILL_AFTER <= len(run["acked"]) < BURST


@pytest.fixture(scope="module")
def second(run: dict[str, Any], first: RunningServer) -> Iterator[RunningServer]:
    """The same state file, started again with two workers."""
    kill_tree(first)
    config = merge(run["config"], {"ServerConfig": {"workers": 2}})
    server = start_server(run["dir"] / "run2", config)
    try:
        wait_ready(server, READY_S)
        yield server
    finally:
        server.stop()


def test_a_restart_restores_exactly_the_acknowledged_registrations(
    second: RunningServer, run: dict[str, Any]
) -> None:
    listed = names(second)
    registered = {n for n in listed if n.startswith(("burst-", "refused-"))} | (
        {"kept", "by-vllm"} & listed
    )
    assert run["acked"] <= registered, sorted(run["acked"] - registered)[:10]
    assert registered <= run["sent"] | {"kept", "by-vllm"}  # nothing refused or never sent
    in_flight = registered - run["acked"]
    assert len(in_flight) <= 16, sorted(in_flight)
    with management_client(second, timeout=60) as mgmt:
        assert describe(mgmt, "kept")["pin"] is False  # the refused update did not happen
    generates(second, "kept")


def test_two_workers_refuse_alike_and_keep_one_view(
    second: RunningServer, state_dir: Path
) -> None:
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=second.url, timeout=60, limits=no_reuse) as http:
        before = names(second, http)
        remount(state_dir, "ro")
        try:
            refused_everywhere(second, attempts=4)
            views = [names(second, http) for _ in range(8)]
        finally:
            remount(state_dir, "rw")
        assert all(view == before for view in views)
    refusing = set(re.findall(r"(worker-\d) \[[^]]*\] (?:POST|DELETE) \S+ 507 ", second.log()))
    assert refusing == {"worker-0", "worker-1"}, second.log()[-3000:]
    with management_client(second, timeout=60) as mgmt:
        ok = mgmt.post("/models/tiny/adapters", params={"name": "after-rw", "src": SRC})
        assert ok.status_code == 200, ok.text
    with httpx.Client(base_url=second.url, timeout=60, limits=no_reuse) as http:
        assert all("after-rw" in names(second, http) for _ in range(8))
