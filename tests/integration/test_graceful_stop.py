"""Graceful stop through real sockets: GET /stopService and SIGTERM on the real engine with 32
mixed-protocol requests in flight, and the drain timeout / Force paths on the fake engine.

Each test starts its own server (the shared one must keep running): two real-engine starts,
two fake-engine starts.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.record import process_roles
from bench.servers import alive_after
from tests.integration.traffic import (
    MIX,
    Outcome,
    async_management_client,
    complete,
    launch,
    refused_while_draining,
    sse_payloads,
)
from tests.serverproc import RunningServer, running_server, start_up_problems

pytestmark = pytest.mark.anyio
TOKENS = 400  # long enough that every request is surely in flight when the stop comes
REAL = {"LimitsConfig": {"maxConcurrentRequests": 64, "maxQueue": 64, "drainTimeout": 120}}
WAIT_S = 120.0


def data_client(server: RunningServer) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    return httpx.AsyncClient(base_url=server.url, timeout=WAIT_S, limits=limits)


async def all_started(outcomes: list[Outcome]) -> None:
    await asyncio.wait_for(asyncio.gather(*(o.started.wait() for o in outcomes)), WAIT_S)


async def inflight(management: httpx.AsyncClient) -> int:
    status = (await management.get("/v1/status")).json()
    count: int = status["gateway"]["inflight"]
    return count


async def check_draining_plane(server: RunningServer, data: httpx.AsyncClient) -> list[str]:
    """While draining: readiness 503 everywhere, liveness 200, new requests 503 per protocol."""
    problems = await refused_while_draining(data)
    async with async_management_client(server) as management:
        ready = await management.get("/v2/health/ready")
        live = await management.get("/v2/health/live")
    tgi_health = await data.get("/health")
    kserve_ready = await data.get("/v2/health/ready")
    if ready.status_code != 503 or live.status_code != 200:
        problems.append(f"management ready {ready.status_code} live {live.status_code}")
    if tgi_health.status_code != 503 or kserve_ready.status_code == 200:
        problems.append(f"data /health {tgi_health.status_code} /v2 {kserve_ready.status_code}")
    return problems


async def drain_under_load(server: RunningServer, stop: Any) -> dict[str, Any]:
    """Start the mixed load, stop the server with `stop()`, check the drain; returns findings."""
    async with (
        data_client(server) as data,
        async_management_client(server, timeout=WAIT_S) as management,
    ):
        outcomes, tasks = launch(data, TOKENS)
        await all_started(outcomes)
        before = await inflight(management)
        stopping = asyncio.create_task(stop(management))
        while (await data.get("/health")).status_code == 200:  # noqa: ASYNC110 (polls a peer)
            await asyncio.sleep(0.02)
        problems = await check_draining_plane(server, data)
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
        stop_result = await stopping
    exit_code = await asyncio.to_thread(server.process.wait, WAIT_S)
    return {
        "before": before,
        "problems": problems,
        "exit": exit_code,
        "stop": stop_result,
        "incomplete": [p for p in (complete(o, TOKENS) for o in outcomes) if p],
        "count": len(outcomes),
    }


@pytest.mark.engine
async def test_stop_service_drains_32_mixed_requests_then_exits_0(tmp_path: Path) -> None:
    async def stop(management: httpx.AsyncClient) -> list[tuple[int, bytes]]:
        first = asyncio.create_task(management.get("/stopService"))
        await asyncio.sleep(0.2)
        second = await management.get("/stopService")  # a second call is harmless
        responses = [await first, second]
        return [(r.status_code, r.content) for r in responses]

    with running_server(tmp_path, overrides=REAL) as server:
        found = await drain_under_load(server, stop)
        log = server.log()
    assert found["count"] == 32 == sum(count for _, _, count in MIX)
    assert found["before"] >= 24, found  # nearly all of them were in flight at the stop
    assert found["problems"] == []
    assert found["incomplete"] == []
    assert found["stop"] == [(200, b""), (200, b"")]
    assert found["exit"] == 0, log[-3000:]
    assert "aborted" not in log


@pytest.mark.engine
async def test_sigterm_drains_32_mixed_requests_then_exits_0(tmp_path: Path) -> None:
    with running_server(tmp_path, overrides=REAL) as server:

        async def stop(management: httpx.AsyncClient) -> None:
            server.process.send_signal(signal.SIGTERM)

        found = await drain_under_load(server, stop)
        log = server.log()
    assert found["count"] == 32
    assert found["before"] >= 24, found
    assert found["problems"] == []
    assert found["incomplete"] == []
    assert found["exit"] == 0, log[-3000:]
    assert "SIGTERM: draining" in log
    assert start_up_problems(log) == []


@pytest.mark.engine
async def test_a_killed_gateway_takes_its_engine_core_down(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer, kill -9) runs no shutdown: vLLM's engine core, a child of the
    gateway, must see its parent gone and stop, its worker with it, not hold the model's memory
    with nobody to serve (server/engines/vllm_parent_watch.py)."""
    with running_server(tmp_path) as server:
        engine = [pid for pid, (role, _) in process_roles(server.process.pid).items()
                  if role == "engine"]
        server.process.kill()
        server.process.wait(10)
        left = alive_after(engine, WAIT_S)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        log = server.log()
    assert len(engine) == 2, engine  # the engine core and its worker
    assert left == [], log[-3000:]
    assert "is gone: stopping the engine core" in log


SLOW_FAKE = {
    "ModelConfig": {"engineOptions": {"token_delay_s": 0.1}},
    "LimitsConfig": {"drainTimeout": 1},
}


async def slow_requests(data: httpx.AsyncClient) -> tuple[list[Outcome], list[asyncio.Task[None]]]:
    outcomes, tasks = launch(data, TOKENS)  # 40 s each on the slow fake engine
    await all_started(outcomes)
    return outcomes, tasks


def ended_with_in_band_error(outcome: Outcome) -> bool:
    """A stream that had started is cut with its protocol's error event; a non-streamed
    request gets its protocol's 503."""
    if outcome.kind == "openai-completion":
        return outcome.status == 503 and outcome.events[0]["error"]["code"] == 503
    if outcome.kind == "mindie-generate-stream":
        return outcome.status == 200 and "error" in outcome.events[-1]
    last = outcome.events[-2] if outcome.events[-1] == "[DONE]" else outcome.events[-1]
    return outcome.status == 200 and "error" in last


async def test_drain_timeout_aborts_the_rest_with_an_in_band_error(tmp_path: Path) -> None:
    with running_server(tmp_path, engine="fake", overrides=SLOW_FAKE) as server:
        async with (
            data_client(server) as data,
            async_management_client(server, timeout=WAIT_S) as management,
        ):
            outcomes, tasks = await slow_requests(data)
            stop = await management.get("/stopService")
            await asyncio.gather(*tasks)
        exit_code = await asyncio.to_thread(server.process.wait, WAIT_S)
        log = server.log()
    assert stop.status_code == 200
    cut = [o for o in outcomes if not ended_with_in_band_error(o)]
    assert cut == []
    chat = next(o for o in outcomes if o.kind == "openai-chat-stream")
    assert chat.events[-1] == "[DONE]"  # OpenAI streams still end with their terminator
    assert exit_code == 0
    assert "aborted 32 requests" in log


async def test_force_stop_aborts_at_once_and_exits_0(tmp_path: Path) -> None:
    overrides = {**SLOW_FAKE, "LimitsConfig": {"drainTimeout": 600}}
    with running_server(tmp_path, engine="fake", overrides=overrides) as server:
        async with (
            data_client(server) as data,
            async_management_client(server, timeout=WAIT_S) as management,
        ):
            outcomes, tasks = await slow_requests(data)
            stop = await management.get("/stopService", params={"mode": "Force"})
            await asyncio.gather(*tasks)
        exit_code = await asyncio.to_thread(server.process.wait, WAIT_S)
    assert stop.status_code == 200
    assert all(ended_with_in_band_error(o) for o in outcomes)
    assert exit_code == 0


def test_sse_payloads_reads_both_spacings() -> None:
    assert sse_payloads('data: {"a":1}\n\ndata:{"b":2}\n\n') == ['{"a":1}', '{"b":2}']
