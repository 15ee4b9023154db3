"""`/health/timed`'s probe gate (protocols/mindie/probe.py): one probe generation at a time, a
fresh result reused, so the open route cannot load the engine (issue 19 item 4)."""

from __future__ import annotations

import asyncio

import pytest

from protocols.mindie.probe import ProbeGate, ProbeResult
from server.engines.fake import FakeScript
from tests.unit.gateway_kit import client, make_gateway

pytestmark = pytest.mark.anyio


def probes(gateway: object) -> int:
    return sum(r.protocol == "health" for r in gateway.engine.requests)  # type: ignore[attr-defined]


async def test_concurrent_probes_run_one_generation_and_all_answer_healthy() -> None:
    gateway = make_gateway(FakeScript(token_delay_s=0.05))
    async with client(gateway) as http:
        answers = await asyncio.gather(*[http.get("/health/timed-5") for _ in range(16)])
    assert {(a.status_code, a.text) for a in answers} == {(200, '{"status":"healthy"}')}
    assert probes(gateway) == 1


async def test_a_fresh_result_is_reused_and_an_old_one_is_not() -> None:
    gateway = make_gateway()
    now = [100.0]
    gate = ProbeGate(gateway.service, reuse_s=1.0, clock=lambda: now[0])
    assert await gate.check(5) == ProbeResult()
    now[0] += 0.9
    assert await gate.check(5) == ProbeResult()
    assert probes(gateway) == 1
    now[0] += 0.2
    await gate.check(5)
    assert probes(gateway) == 2


async def test_a_failed_probe_is_reused_too_and_reported_as_500() -> None:
    gateway = make_gateway(FakeScript(fail_after=0))
    async with client(gateway) as http:
        first, second = await http.get("/health/timed-5"), await http.get("/health/timed-5")
    assert first.status_code == second.status_code == 500
    assert first.json() == second.json()
    assert probes(gateway) == 1


async def test_a_caller_waiting_on_a_hung_probe_gets_500_after_its_own_wait() -> None:
    gateway = make_gateway(FakeScript(hang_after=0))
    gate = ProbeGate(gateway.service)
    starter = asyncio.create_task(gate.check(3))
    await asyncio.sleep(0.05)
    joined = await gate.check(1)
    assert joined.failure == "The health probe did not finish within 1 s"
    assert (await starter).failure == "The health probe did not finish within 3 s"
    assert probes(gateway) == 1
    assert gateway.lifecycle.inflight == 0
