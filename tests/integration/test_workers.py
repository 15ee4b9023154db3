"""`ServerConfig.workers: 2` on the real engine: two front-end processes, one engine core, one
adapter registry, one lifecycle; and on the fake engine, what happens when a worker dies.

The real server's engine is pinned to CPU 1 (`VLLM_CPU_OMP_THREADS_BIND`): the session's shared
server may run beside it (docs/operations.md, replicas on one host). Its last test stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.servers import alive_after, process_alive
from server.core.json_limits import MAX_JSON_DEPTH
from tests.integration.sources_kit import S3_ENV, MotoServer
from tests.integration.traffic import (
    Outcome,
    async_management_client,
    complete,
    launch,
    management_client,
    openai_chat_stream,
)
from tests.serverproc import (
    DEMO,
    RunningServer,
    base_config,
    merge,
    running_server,
    start_server,
)

PINNED = {"VLLM_CPU_OMP_THREADS_BIND": "1"}
WORKERS = {
    "ServerConfig": {"workers": 2, "drainDelay": 5},  # the default lame-duck period on stop
    "ModelConfig": {"maxNumSeqs": 64},  # the drain test's 64 requests all run at once
    "LimitsConfig": {"maxConcurrentRequests": 128, "maxQueue": 128, "drainTimeout": 120},
}
PROMPT = "the two workers share one engine"
TOKENS = 12
DRAIN_TOKENS = 300
WAIT_S = 120.0


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """An S3 server whose adapters the workers' server finds through `adapterSources`."""
    moto = MotoServer(tmp_path_factory.mktemp("moto"))
    moto.start()
    try:
        moto.upload("adapters", "team1/w-a2", DEMO / "adapters" / "a2")
        yield moto
    finally:
        moto.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, s3: MotoServer) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("workers")
    sources = {"LoraConfig": {"adapterSources": ["s3://adapters/team1/"],
                              "adapterCacheDir": str(folder / "cache")}}
    environ = {**PINNED, **S3_ENV, "AWS_ENDPOINT_URL_S3": s3.url}
    with running_server(folder, overrides={**WORKERS, **sources}, environ=environ,
                        ready_timeout=600) as running:
        yield running


def fresh_connections(server: RunningServer) -> httpx.Client:
    """A client that opens a new connection per request, so requests spread over the workers
    (each accepted connection lands on whichever worker accepts it first)."""
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.Client(base_url=server.url, timeout=60, limits=limits)


def test_first_requests_on_both_workers_fetch_a_source_adapter_once(
    server: RunningServer, s3: MotoServer
) -> None:
    """Sixteen first requests over both workers for an adapter only the S3 server has: one
    download of each object (the registry's owner fetches for every worker), one answer."""
    body = {"model": "w-a2", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    with fresh_connections(server) as client, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: client.post("/v1/completions", json=body), range(16)))
        reference = client.post("/v1/completions", json={**body, "model": "a2"})
    assert {a.status_code for a in answers} == {200}
    assert {a.json()["choices"][0]["text"] for a in answers} == {
        reference.json()["choices"][0]["text"]
    }
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        assert s3.gets(f"team1/w-a2/{file}") == 1


def completion(http: httpx.Client, model: str) -> tuple[str, str]:
    """(the worker that answered, by its response-id prefix; the greedy text)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["id"][:21], answer["choices"][0]["text"]


def worker_pids(log: str) -> dict[str, int]:
    return {name: int(pid) for name, pid in re.findall(r"(worker-\d) pid (\d+)", log)}


@pytest.mark.engine
def test_both_workers_answer_and_turned_ready_together(server: RunningServer) -> None:
    with fresh_connections(server) as http:
        answered = Counter(completion(http, "tiny")[0] for _ in range(30))
    assert len(answered) == 2, answered
    log = server.log()
    assert re.search(r"worker-0 \[-\] start-up ready", log)
    assert re.search(r"worker-1 \[-\] start-up ready", log)
    assert "engine core for 2 workers" in log
    assert log.count("Initializing a V1 LLM engine") == 1  # one engine core


@pytest.mark.engine
def test_every_worker_refuses_too_deep_json_and_unserved_knobs(server: RunningServer) -> None:
    """The depth rule and the knob refusals (issue 19) on each worker: requests on fresh
    connections spread over both; every one is refused in OpenAI's shape, naming the limit."""
    deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    hostile = [
        ('{"model":"tiny","prompt":' + deep + "}", f"at most {MAX_JSON_DEPTH} levels"),
        ('{"model":"tiny","prompt":"hi","best_of":1000000}', "best_of must be between"),
        ('{"model":"tiny","prompt":"hi","best_of":3,"n":2}', "best_of > n is not supported"),
        ('{"model":"tiny","prompt":"hi","watermarking":true}', "`watermarking` is not supported"),
    ]
    answered: set[str] = set()
    with fresh_connections(server) as http:
        for i in range(12):
            body, message = hostile[i % len(hostile)]
            response = http.post("/v1/completions", content=body,
                                 headers={"content-type": "application/json"})
            assert response.status_code == 400, response.text
            assert message in response.json()["error"]["message"]
            answered.add(completion(http, "tiny")[0])
    assert len(answered) == 2  # both workers took requests in between


@pytest.mark.engine
@pytest.mark.parametrize("api", ["djl", "vllm"])
def test_an_adapter_registered_on_any_worker_is_served_by_both_as_soon_as_it_answers(
    server: RunningServer, tmp_path: Path, api: str
) -> None:
    """100 requests right after the registration answers, spread over both workers, all equal
    to the same weights registered at start-up (a2, from the adapter folder)."""
    name = f"copy-{api}"
    src = DEMO / "test-adapters" / f"workers-{api}"  # inside the test server's adapterRoots
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(DEMO / "adapters" / "a2", src)
    try:
        with fresh_connections(server) as http:
            expected = completion(http, "a2")[1]
            assert expected != completion(http, "tiny")[1]
            _register(server, http, api, name, src)
            answers = [completion(http, name) for _ in range(100)]
            _unregister(server, http, api, name)
            gone = [http.post("/v1/completions", json={"model": name, "prompt": "x"})
                    for _ in range(20)]
    finally:
        shutil.rmtree(src, ignore_errors=True)
    assert len({worker for worker, _ in answers}) == 2
    assert [text for _, text in answers] == [expected] * 100
    assert {r.status_code for r in gone} == {404}


def _register(server: RunningServer, http: httpx.Client, api: str, name: str, src: Path) -> None:
    if api == "djl":
        with management_client(server, timeout=60) as mgmt:
            response = mgmt.post("/models/tiny/adapters", params={"name": name, "src": str(src)})
    else:
        response = http.post("/v1/load_lora_adapter",
                             json={"lora_name": name, "lora_path": str(src)})
    assert response.status_code == 200, response.text


def _unregister(server: RunningServer, http: httpx.Client, api: str, name: str) -> None:
    if api == "djl":
        with management_client(server, timeout=60) as mgmt:
            response = mgmt.delete(f"/models/tiny/adapters/{name}")
    else:
        response = http.post("/v1/unload_lora_adapter", json={"lora_name": name})
    assert response.status_code == 200, response.text


@pytest.mark.engine
def test_a_role_set_through_one_worker_is_every_workers_role(server: RunningServer) -> None:
    with management_client(server, timeout=60) as mgmt, fresh_connections(server) as http:
        assert mgmt.post("/v1/role/decode").status_code == 200
        try:
            refused = [http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
                       for _ in range(20)]
        finally:
            assert mgmt.post("/v1/role/flex").status_code == 200
        served = [http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
                  for _ in range(10)]
    assert {r.status_code for r in refused} == {503}
    assert {r.status_code for r in served} == {200}


@pytest.mark.engine
@pytest.mark.anyio
async def test_a_drain_with_64_requests_in_flight_across_workers_loses_none(
    server: RunningServer,
) -> None:
    """The module's last test: SIGTERM to the supervisor with 64 mixed-protocol requests in
    flight on both workers; during the lame-duck period (drainDelay, its default) readiness
    fails and new requests are served by both workers; every one completes, the server exits
    0."""
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S, limits=limits) as data:
        first, first_tasks = launch(data, DRAIN_TOKENS)
        second, second_tasks = launch(data, DRAIN_TOKENS)
        outcomes: list[Outcome] = first + second
        await asyncio.wait_for(asyncio.gather(*(o.started.wait() for o in outcomes)), WAIT_S)
        await _until_inflight(server, 64)
        server.process.send_signal(signal.SIGTERM)
        lame_duck = await _served_in_the_lame_duck_period(server)
        await asyncio.wait_for(asyncio.gather(*first_tasks, *second_tasks), WAIT_S)
    exit_code = await asyncio.to_thread(server.process.wait, WAIT_S)
    log = server.log()
    assert lame_duck == ({200}, 2)
    assert log.count("lame duck for 5.0s") == 2
    assert len(outcomes) == 64
    assert [p for p in (complete(o, DRAIN_TOKENS) for o in outcomes) if p] == []
    assert exit_code == 0, log[-3000:]
    assert "worker-0 [-] SIGTERM: draining" in log and "worker-1 [-] SIGTERM: draining" in log
    assert "aborted" not in log


async def _served_in_the_lame_duck_period(server: RunningServer) -> tuple[set[int], int]:
    """Once readiness fails (eight times in a row, on fresh connections: both workers), 16 new
    completions at once, each on its own connection: their statuses, how many workers answered
    them."""
    limits = httpx.Limits(max_keepalive_connections=0)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S, limits=limits) as http:
        deadline, failing = time.monotonic() + WAIT_S, 0
        while failing < 8 and time.monotonic() < deadline:
            failing = failing + 1 if (await http.get("/health")).status_code == 503 else 0
        answers = await asyncio.gather(
            *(http.post("/v1/completions", json=body) for _ in range(16))
        )
    workers = {a.json()["id"][:21] for a in answers if a.status_code == 200}
    return {a.status_code for a in answers}, len(workers)


async def _until_inflight(server: RunningServer, count: int) -> None:
    """Until both workers together report `count` requests in flight (each worker's status
    counts its own, so ask until both have answered)."""
    deadline = time.monotonic() + WAIT_S
    async with async_management_client(server, timeout=10,
                                        limits=httpx.Limits(max_keepalive_connections=0)) as m:
        while time.monotonic() < deadline:
            seen: dict[int, int] = {}
            for _ in range(8):
                status = (await m.get("/v1/status")).json()
                seen[status["gateway"]["pid"]] = status["gateway"]["inflight"]
            if len(seen) == 2 and sum(seen.values()) >= count:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"never {count} requests in flight")


# ---- a worker dies (fake engine: nothing else about the engine matters here) ------------------

def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True, check=False).stdout
    return [int(p) for p in out.split()]


def test_a_worker_that_dies_takes_the_server_down_cleanly(tmp_path: Path) -> None:
    with running_server(tmp_path, engine="fake", overrides=WORKERS) as server:
        pids = worker_pids(server.log())
        assert set(pids) == {"worker-0", "worker-1"}
        assert set(pids.values()) <= set(_children(server.process.pid))
        os.kill(pids["worker-1"], signal.SIGKILL)
        code = server.process.wait(60)
        log = server.log()
    assert code == 1, log[-3000:]
    assert "worker-1 exited (code -9): stopping the server" in log
    assert "worker-0 [-] SIGTERM: draining" in log
    assert all(not process_alive(pid) for pid in pids.values())


@pytest.mark.engine
def test_an_engine_core_that_dies_takes_every_worker_down(tmp_path: Path) -> None:
    with running_server(tmp_path, overrides=WORKERS, environ=PINNED) as server:
        pids = worker_pids(server.log())
        cores = [pid for pid, name in _named_children(server.process.pid)
                 if name.startswith("VLLM::EngineCor")]
        assert len(cores) == 1
        os.kill(cores[0], signal.SIGKILL)
        code = server.process.wait(120)
        log = server.log()
    assert code == 1, log[-3000:]
    assert "an engine process died: stopping the server" in log
    assert all(not process_alive(pid) for pid in pids.values())


def _named_children(pid: int) -> list[tuple[int, str]]:
    out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(pid)], capture_output=True,
                         text=True, check=False).stdout
    return [(int(line.split()[0]), line.split()[1]) for line in out.splitlines() if line.strip()]


def test_stop_service_on_any_worker_stops_every_worker(tmp_path: Path) -> None:
    with running_server(tmp_path, engine="fake", overrides=WORKERS) as server:
        with management_client(server, timeout=30) as mgmt:
            assert mgmt.get("/stopService").status_code == 200
        code = server.process.wait(60)
        log = server.log()
    assert code == 0, log[-3000:]
    assert "a worker was asked to stop: draining every worker" in log
    assert log.count("[-] draining 0 requests") == 2


@pytest.mark.anyio
async def test_a_forced_stop_service_on_one_worker_aborts_every_workers_streams_at_once(
    tmp_path: Path,
) -> None:
    """GET /stopService?mode=Force on one worker while 16 streams that never end (the fake
    engine hangs after two tokens) run on both: every worker forces (no lame-duck period, no
    wait for the streams), each stream ends with OpenAI's in-band 503, the server exits 0."""
    hanging = {**WORKERS, "ModelConfig": {"engineOptions": {"hang_after": 2}}}
    with running_server(tmp_path, engine="fake", overrides=hanging) as server:
        limits = httpx.Limits(max_keepalive_connections=0)  # spread over both workers
        async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S, limits=limits) as data:
            outcomes = [Outcome("openai-chat-stream") for _ in range(16)]
            tasks = [asyncio.create_task(openai_chat_stream(data, o, 50)) for o in outcomes]
            await asyncio.wait_for(asyncio.gather(*(o.started.wait() for o in outcomes)), WAIT_S)
            await _until_inflight(server, 16)  # both workers hold some
            async with async_management_client(server, timeout=WAIT_S) as mgmt:
                forced = await mgmt.get("/stopService", params={"mode": "Force"})
            await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
        code = await asyncio.to_thread(server.process.wait, WAIT_S)
        log = server.log()
    assert forced.status_code == 200
    assert code == 0, log[-3000:]
    assert {o.status for o in outcomes} == {200}
    assert [o.events[-2]["error"]["code"] for o in outcomes] == [503] * 16
    assert all(o.events[-1] == "[DONE]" for o in outcomes)
    assert log.count("a worker was asked to stop at once: forcing every worker") == 1
    assert "lame duck" not in log
    assert re.search(r"worker-0 \[-\] drain ended before idle: aborted \d+ requests", log)
    assert re.search(r"worker-1 \[-\] drain ended before idle: aborted \d+ requests", log)


def test_management_calls_on_a_worker_whose_registry_owner_died_get_503_at_once(
    tmp_path: Path,
) -> None:
    """Worker 0 (the adapter registry's owner) is killed; worker 1, in its lame-duck period,
    answers every adapter call at once with a 503 in the call's protocol shape (none waits for
    a reply that cannot come); a forced stop then ends the server (code 1: a worker died)."""
    lame_duck = {**WORKERS, "ServerConfig": {"workers": 2, "drainDelay": 600}}
    src = str(DEMO / "adapters" / "a1")
    with running_server(tmp_path, engine="fake", overrides=lame_duck) as server:
        os.kill(worker_pids(server.log())["worker-0"], signal.SIGKILL)
        _until_logged(server, "the adapter registry's owner went away", "lame duck for 600.0s")
        with management_client(server, timeout=WAIT_S) as mgmt:  # worker 1 alone listens now
            calls = [mgmt.post("/models/tiny/adapters", params={"name": "late", "src": src}),
                     mgmt.delete("/models/tiny/adapters/a1"),
                     httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=WAIT_S,
                                json={"lora_name": "late", "lora_path": src})]
            mgmt.get("/stopService", params={"mode": "Force"})
        code = server.process.wait(WAIT_S)
        log = server.log()
    assert code == 1, log[-3000:]
    assert "the adapter registry's owner went away" in log
    assert [c.status_code for c in calls] == [503, 503, 503], [c.text for c in calls]
    unreachable = "the adapter registry is not reachable"
    djl = {"code": 503, "type": "ServiceUnavailableException", "message": unreachable}
    assert [c.json() for c in calls[:2]] == [djl, djl]
    assert calls[2].json()["error"]["message"] == unreachable
    assert "timeout graceful shutdown exceeded" not in log


def _until_logged(server: RunningServer, *lines: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(line in server.log() for line in lines):
        assert time.monotonic() < deadline, f"never logged {lines}"
        time.sleep(0.05)


def test_workers_stop_when_their_supervisor_is_killed(tmp_path: Path) -> None:
    with running_server(tmp_path, engine="fake", overrides=WORKERS) as server:
        pids = worker_pids(server.log())
        server.process.kill()
        server.process.wait(10)
        _assert_orphans_stop(server, pids)


def test_workers_stop_when_their_supervisor_is_killed_while_they_start(tmp_path: Path) -> None:
    """Killed before the workers turned ready, so before their watch on it began: they must
    still see that the supervisor is gone, not take whoever adopted them for it."""
    server = start_server(tmp_path, merge(base_config("fake"), WORKERS))
    deadline = time.monotonic() + WAIT_S
    while len(pids := worker_pids(server.log())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.process.kill()
    server.process.wait(10)
    assert "start-up ready" not in server.log()
    _assert_orphans_stop(server, pids)


def _assert_orphans_stop(server: RunningServer, pids: dict[str, int]) -> None:
    try:
        left = alive_after(list(pids.values()), 30)
        log = server.log()
        assert not left, log[-4000:]
        assert log.count("the supervisor is gone: stopping") == 2, log[-4000:]
    finally:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_metrics_count_requests_exactly_across_workers(tmp_path: Path) -> None:
    with running_server(tmp_path, engine="fake", overrides=WORKERS) as server:
        before = _counter(server, "gateway_http_requests_total")
        with fresh_connections(server) as http:
            answered = Counter(completion(http, "tiny")[0] for _ in range(40))
        after = _counter(server, "gateway_http_requests_total")
    assert len(answered) == 2
    assert after - before == 40


def _counter(server: RunningServer, family: str) -> float:
    """Sum of a family's completions-route samples, scraped on a fresh connection."""
    text = httpx.get(f"{server.metrics_url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(family) and 'endpoint="/v1/completions"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
