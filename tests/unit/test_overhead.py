"""`X-Gateway-Overhead-Ms`: the gateway's own time on every response, the engine's time excluded
(server/core/overhead.py, server/http/app.py), on the fake engine with a fixed token delay."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from server.core.overhead import EngineWait, engine_wait_var, on_engine
from server.engines.fake import FakeScript
from tests.unit.gateway_kit import client, make_gateway

pytestmark = pytest.mark.anyio

DELAY_S = 0.05  # per token
TOKENS = 4
ENGINE_MS = DELAY_S * TOKENS * 1000  # the engine's time for one whole answer
KSERVE_TEXT = [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a b"]}]

# One request of every protocol, non-streamed then streamed: (path, body).
ANSWERS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"model": "tiny", "prompt": "a b", "max_tokens": TOKENS}),
    ("/v1/chat/completions", {"model": "tiny", "max_tokens": TOKENS,
                              "messages": [{"role": "user", "content": "a b"}]}),
    ("/generate", {"inputs": "a b", "parameters": {"max_new_tokens": TOKENS}}),
    ("/v2/models/tiny/generate", {"text_input": "a b", "parameters": {"max_tokens": TOKENS}}),
    ("/v2/models/tiny/infer", {"inputs": KSERVE_TEXT, "parameters": {"max_tokens": TOKENS}}),
    ("/infer", {"inputs": "a b", "parameters": {"max_new_tokens": TOKENS}}),
    ("/invocations", {"inputs": "a b", "parameters": {"max_new_tokens": TOKENS}}),
]
STREAMS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {**ANSWERS[0][1], "stream": True}),
    ("/v1/chat/completions", {**ANSWERS[1][1], "stream": True}),
    ("/generate_stream", ANSWERS[2][1]),
    ("/v2/models/tiny/generate_stream", ANSWERS[3][1]),
    ("/infer", {**ANSWERS[5][1], "stream": True}),
    ("/invocations", {**ANSWERS[6][1], "stream": True}),
]


def overhead_ms(headers: Any) -> float:
    value = float(headers["x-gateway-overhead-ms"])
    assert value >= 0.0
    return value


@pytest.mark.parametrize(("path", "body"), ANSWERS, ids=[p for p, _ in ANSWERS])
async def test_a_whole_answer_says_its_overhead_without_the_engine_time(
    path: str, body: dict[str, Any]
) -> None:
    gateway = make_gateway(FakeScript(token_delay_s=DELAY_S))
    async with client(gateway, "data") as http:
        started = time.perf_counter()
        response = await http.post(path, json=body)
        wall_ms = (time.perf_counter() - started) * 1000
    assert response.status_code == 200, response.text
    assert wall_ms >= ENGINE_MS  # the engine's time is in the wall time ...
    overhead = overhead_ms(response.headers)
    assert overhead < ENGINE_MS / 2  # ... and not in the overhead
    assert overhead <= wall_ms - ENGINE_MS + 1.0


@pytest.mark.parametrize(("path", "body"), STREAMS, ids=[p for p, _ in STREAMS])
async def test_a_stream_says_its_overhead_to_the_first_byte(
    path: str, body: dict[str, Any]
) -> None:
    gateway = make_gateway(FakeScript(token_delay_s=DELAY_S))
    async with client(gateway, "data") as http:
        started = time.perf_counter()
        async with http.stream("POST", path, json=body) as response:
            first_byte_ms = (time.perf_counter() - started) * 1000
            text = (await response.aread()).decode()
    assert response.status_code == 200, text
    assert first_byte_ms >= DELAY_S * 1000  # the engine's first output came before the headers
    overhead = overhead_ms(response.headers)
    assert overhead < DELAY_S * 1000 / 2
    assert overhead <= first_byte_ms - DELAY_S * 1000 + 1.0


async def test_refusals_and_control_routes_say_their_overhead_too() -> None:
    gateway = make_gateway()
    async with client(gateway, "data") as http:
        unknown = await http.post("/v1/completions", json={"model": "nope", "prompt": "a"})
        missing = await http.get("/no/such/path")
    async with client(gateway, "metrics") as http:
        metrics = await http.get("/metrics")
    assert unknown.status_code == 404 and missing.status_code == 404
    assert metrics.status_code == 200
    for response in (unknown, missing, metrics):
        overhead_ms(response.headers)


async def test_a_queued_request_does_not_count_its_wait_for_a_slot() -> None:
    """Five requests on four slots: the fifth waits for a whole answer in the queue."""
    gateway = make_gateway(FakeScript(token_delay_s=DELAY_S))
    body = ANSWERS[0][1]
    async with client(gateway, "data") as http:
        responses = await asyncio.gather(*(http.post("/v1/completions", json=body)
                                           for _ in range(5)))
    assert [r.status_code for r in responses] == [200] * 5
    assert max(overhead_ms(r.headers) for r in responses) < ENGINE_MS / 2


async def test_concurrent_waits_count_once() -> None:
    wait = EngineWait()
    token = engine_wait_var.set(wait)
    try:
        started = time.perf_counter()
        await asyncio.gather(on_engine(asyncio.sleep(0.05)), on_engine(asyncio.sleep(0.05)))
        elapsed = time.perf_counter() - started
    finally:
        engine_wait_var.reset(token)
    assert 0.05 <= wait.seconds <= elapsed


async def test_nothing_is_measured_outside_a_request() -> None:
    assert engine_wait_var.get() is None
    assert await on_engine(asyncio.sleep(0, "done")) == "done"
