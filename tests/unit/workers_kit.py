"""A front-end worker process for the multiprocess metrics tests: started with the "spawn"
context and `PROMETHEUS_MULTIPROC_DIR` set (as the supervisor starts one), it builds its own
gateway on the fake engine, makes a known amount of traffic, then answers commands on a pipe:
render /metrics and /metrics-json, exit, or end at once (a crash: no clean-up at all)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from multiprocessing.connection import Connection

from server.core.stream import Timing
from server.core.types import GenerationRequest, Sampling, TextPrompt, Usage
from server.gateway import Gateway, register_startup_adapters
from tests.unit.demo_kit import unit_demo
from tests.unit.gateway_kit import client, make_gateway

SLOTS = 2


@dataclass(frozen=True)
class Plan:
    generations: int  # tgi requests through the service ("one two three": 3 prompt tokens, 5 out)
    failures: int  # openai requests refused as unavailable
    inflight: int  # mindie requests admitted and never finished
    queued_a1: int  # waiting for a slot on adapter a1 (one more waits on the base model)
    first_token_s: tuple[float, ...]  # djl requests finished with these times (MindIE windows)


@dataclass(frozen=True)
class Ready:
    pid: int
    ttft_sum: float  # the worker's MindIE windows after the plan
    ttft_count: int
    tbt_sum: float
    tbt_count: int


def request(protocol: str, *, model: str = "", tokens: int = 5) -> GenerationRequest:
    return GenerationRequest(
        request_id=protocol,
        model=model,
        prompt=TextPrompt("one two three"),
        sampling=Sampling(max_new_tokens=tokens),
        protocol=protocol,
    )


def worker(conn: Connection, plan: Plan) -> None:
    asyncio.run(_serve(conn, plan))


async def _serve(conn: Connection, plan: Plan) -> None:
    demo = unit_demo()
    gateway = make_gateway(overrides={
        "LoraConfig": {"adapterDir": str(demo / "adapters"), "adapterRoots": [str(demo)]},
        "LimitsConfig": {"maxConcurrentRequests": SLOTS, "maxQueue": 32},
    })
    await register_startup_adapters(gateway)
    metrics, admission = gateway.metrics, gateway.service.admission
    for _ in range(plan.generations):
        await gateway.service.generate(request("tgi"))
    async with client(gateway, "data") as http:
        for _ in range(plan.generations):
            await http.get("/v2/health/live")
    for _ in range(plan.failures):
        metrics.rejected(request("openai"), "unavailable")
    for _ in range(plan.inflight):
        metrics.admitted(request("mindie"))
    for seconds in plan.first_token_s:
        metrics.admitted(request("djl"))
        metrics.finished(
            request("djl"), error_type=None, usage=Usage(prompt_tokens=1, completion_tokens=2),
            timing=Timing(seconds=1.0, first_token_s=seconds, mean_token_gap_s=seconds / 10),
        )
    await admission.acquire(SLOTS)
    waiters = [asyncio.create_task(admission.acquire(1, "a1")) for _ in range(plan.queued_a1)]
    waiters.append(asyncio.create_task(admission.acquire(1, "")))
    while admission.waiting < len(waiters):  # noqa: ASYNC110 (no event to wait on)
        await asyncio.sleep(0)
    ttft, tbt = metrics.ttft_window, metrics.tbt_window
    conn.send(Ready(os.getpid(), ttft.mean * len(ttft), len(ttft), tbt.mean * len(tbt), len(tbt)))
    while True:
        command = await asyncio.to_thread(conn.recv)
        if command == "render":
            async with client(gateway, "metrics") as http:
                text = (await http.get("/metrics")).text
                body = (await http.get("/metrics-json")).json()
            conn.send((text, body))
        elif command == "crash":
            os._exit(0)
        else:
            return


async def fixed_traffic(gateway: Gateway) -> str:
    """Observations with fixed times (every bucket edge kind), then the /metrics text."""
    metrics = gateway.metrics
    for protocol, error in (("tgi", None), ("openai", "generation"), ("weird", None)):
        metrics.admitted(request(protocol))
        metrics.first_token(request(protocol), 0.05)
        metrics.token_gaps(request(protocol), [0.01, 0.2, 3.0, 1000.0])
        metrics.finished(
            request(protocol), error_type=error, usage=Usage(prompt_tokens=2, completion_tokens=3),
            timing=Timing(seconds=1.2, first_token_s=0.05, mean_token_gap_s=0.02),
        )
    metrics.admitted(request("mindie"))
    metrics.rejected(request("tgi"), "unavailable")
    metrics.rpc("kserve", "ModelInfer", "OK", 0.1)
    async with client(gateway, "data") as http:
        await http.get("/v2/health/live")
        await http.get("/no/such/route")
    async with client(gateway, "metrics") as http:
        return (await http.get("/metrics")).text


def one_worker(conn: Connection) -> None:
    conn.send(asyncio.run(fixed_traffic(make_gateway())))
