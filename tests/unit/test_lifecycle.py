"""Lifecycle, roles and the drain path in process on the fake engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.core.errors import ServiceUnavailable
from server.core.lifecycle import Lifecycle, Role, State
from server.core.types import Delta, GenerationRequest, Sampling, TextPrompt
from server.engines.fake import FakeScript
from server.runtime.process import drain, watch_engine
from tests.unit.gateway_kit import client, make_gateway

pytestmark = pytest.mark.anyio


def request(rid: str = "r", tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        model="",
        prompt=TextPrompt("one two three"),
        sampling=Sampling(max_new_tokens=tokens),
        stream=True,  # started requests are primed at their first token
        protocol="openai",
    )


def test_states_move_forward_and_failure_sticks() -> None:
    lifecycle = Lifecycle()
    assert lifecycle.state is State.STARTING and not lifecycle.accepting and lifecycle.live
    lifecycle.ready()
    assert lifecycle.accepting
    assert lifecycle.begin_drain() is True
    assert lifecycle.begin_drain() is False  # a second stop is harmless
    assert lifecycle.state is State.DRAINING and not lifecycle.accepting
    lifecycle.stopped()
    assert lifecycle.state is State.STOPPED
    failed = Lifecycle()
    failed.ready()
    failed.fail("engine died")
    failed.begin_drain()
    failed.stopped()
    assert failed.state is State.FAILED and not failed.live and failed.failure == "engine died"


def test_role_switch_only_while_ready() -> None:
    lifecycle = Lifecycle()
    assert lifecycle.switch_role(Role.PREFILL) is False  # still starting
    lifecycle.ready()
    assert lifecycle.switch_role(Role.PREFILL) is True
    lifecycle.begin_drain()
    assert lifecycle.switch_role(Role.DECODE) is False
    assert lifecycle.role is Role.PREFILL


def test_only_decode_refuses_client_requests() -> None:
    assert [r.value for r in Role if r.admits_requests] == ["prefill", "flex"]


async def test_a_queued_request_counts_as_in_flight() -> None:
    gateway = make_gateway(
        FakeScript(hang_after=1), overrides={"LimitsConfig": {"maxConcurrentRequests": 1}}
    )
    running = await gateway.service.start(request("a"))
    queued = asyncio.create_task(gateway.service.start(request("b")))
    await asyncio.sleep(0.01)
    assert gateway.service.admission.waiting == 1
    assert gateway.lifecycle.inflight == 2
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert gateway.lifecycle.inflight == 1  # a cancelled waiter leaves
    await running.aclose()
    assert gateway.lifecycle.inflight == 0


async def test_drain_waits_for_running_and_queued_requests() -> None:
    gateway = make_gateway(
        FakeScript(token_delay_s=0.005), overrides={"LimitsConfig": {"maxConcurrentRequests": 1}}
    )
    first = asyncio.create_task(gateway.service.generate(request("a", tokens=20)))
    second = asyncio.create_task(gateway.service.generate(request("b", tokens=20)))
    await asyncio.sleep(0.01)
    gateway.shutdown.request()
    with pytest.raises(ServiceUnavailable):  # new work is refused at once
        await gateway.service.generate(request("late"))
    await drain(gateway)
    assert gateway.shutdown.drained.is_set()
    assert (await first).usage.completion_tokens == 20
    assert (await second).usage.completion_tokens == 20


async def test_drain_timeout_ends_streams_with_an_in_band_error_and_refuses_the_queue() -> None:
    gateway = make_gateway(
        FakeScript(hang_after=2),
        overrides={"LimitsConfig": {"maxConcurrentRequests": 1, "drainTimeout": 0.1}},
    )
    stream = await gateway.service.start(request("stream", tokens=50))
    queued = asyncio.create_task(gateway.service.start(request("queued")))
    await asyncio.sleep(0.01)
    received: list[object] = []

    async def consume() -> None:
        try:
            async for event in stream:
                received.append(event)
        finally:
            await stream.aclose()

    consumer = asyncio.create_task(consume())
    gateway.shutdown.request()
    await drain(gateway)
    with pytest.raises(ServiceUnavailable, match="shutting down"):
        await consumer
    with pytest.raises(ServiceUnavailable, match="shutting down"):
        await queued
    assert sum(isinstance(e, Delta) for e in received) == 2  # what it had before the abort
    assert gateway.lifecycle.inflight == 0


async def test_engine_watchdog_marks_a_dead_engine_failed(tmp_path: Path) -> None:
    flag = tmp_path / "dead"
    gateway = make_gateway(
        FakeScript(dead_flag_path=str(flag)),
        overrides={"LimitsConfig": {"engineCheckInterval": 0.01}},
    )
    watchdog = asyncio.create_task(watch_engine(gateway))
    await asyncio.sleep(0.05)
    assert gateway.lifecycle.state is State.READY
    flag.touch()
    await asyncio.wait_for(watchdog, 5)
    assert gateway.lifecycle.state is State.FAILED
    assert "dead" in (gateway.lifecycle.failure or "")
    with pytest.raises(ServiceUnavailable):
        await gateway.service.generate(request())


LAME_DUCK = {"ServerConfig": {"drainDelay": 0.3}}
READINESS = ("/v2/health/ready", "/health", "/v2/models/tiny/ready")


async def test_the_lame_duck_period_fails_readiness_at_once_and_serves_new_requests() -> None:
    gateway = make_gateway(FakeScript(), overrides=LAME_DUCK)
    gateway.shutdown.request()
    async with client(gateway) as http:
        for path in READINESS:
            assert (await http.get(path)).status_code == 503, path
    assert gateway.lifecycle.state is State.DRAINING
    draining = asyncio.create_task(drain(gateway))
    served = await gateway.service.generate(request("during the delay", tokens=4))
    assert served.usage.completion_tokens == 4
    assert not draining.done()
    await draining
    with pytest.raises(ServiceUnavailable):  # after the delay: the drain proper
        await gateway.service.generate(request("after"))


async def test_a_forced_stop_ends_the_lame_duck_period_at_once() -> None:
    gateway = make_gateway(FakeScript(), overrides={"ServerConfig": {"drainDelay": 600}})
    gateway.shutdown.request()
    draining = asyncio.create_task(drain(gateway))
    await gateway.service.generate(request("served"))
    gateway.shutdown.request(force=True)
    with pytest.raises(ServiceUnavailable):
        await gateway.service.generate(request("refused"))
    await asyncio.wait_for(draining, 5)
    assert gateway.shutdown.drained.is_set()


def test_only_a_ready_server_has_a_lame_duck_period() -> None:
    starting = Lifecycle()
    starting.begin_drain(lame_duck=True)
    assert not starting.admitting and not starting.lame_duck
    ready = Lifecycle()
    ready.ready()
    ready.begin_drain(lame_duck=True)
    assert ready.admitting and not ready.accepting
    ready.end_lame_duck()
    assert not ready.admitting
