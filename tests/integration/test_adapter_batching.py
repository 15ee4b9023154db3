"""Requests for resident adapters run in the engine together, as base requests do (issue 24), on
the live server (real vLLM engine, maxNumSeqs 32, maxLoras 2, maxCpuLoras 4).

Eight long streams, four on each of two adapters (or all on the base model), are opened at once;
once every stream has its first token, the engine's own running count (`vllm:num_requests_running`,
the scheduler's numbers) must show all eight, none waiting, and no adapter loaded again for them:
nothing in the gateway (residency, admission, the engine adapter) keeps them apart. The streams
are long (400 tokens) and closed by the test once it has read the metrics; the poll's deadline is
a safety bound, never the assertion.

On a server with `maxActiveAdapters` 2 (the strict setting: as many adapters in flight as the
engine runs per step), a third adapter's streams wait in the gateway's queue while a1 and a2 hold
both adapter slots, and start once one drains; an adapter not yet in the engine whose requests
wait is loaded ahead into a spare cached place (prefetch) and starts without a load of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.traffic import async_management_client
from tests.serverproc import DEMO, RunningServer, running_server

STREAMS = 8
HOLD_TOKENS = 400  # the live server's maxModelLen is 512
WAIT_S = 300.0

pytestmark = [pytest.mark.server, pytest.mark.anyio]

Families = dict[str, list[tuple[dict[str, str], float]]]


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    overrides = {"LoraConfig": {"maxActiveAdapters": 2}}
    with running_server(tmp_path_factory.mktemp("strict"), overrides=overrides,
                        ready_timeout=600) as server:
        yield server


def body(model: str, tokens: int, *, stream: bool) -> dict[str, object]:
    return {"model": model, "prompt": "the gateway batches", "max_tokens": tokens,
            "ignore_eos": True, "stream": stream}


async def scrape(server: RunningServer) -> Families:
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.get(f"{server.metrics_url}/metrics")
    assert response.status_code == 200
    families: Families = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            families.setdefault(sample.name, []).append((sample.labels, sample.value))
    return families


def total(families: Families, name: str) -> float:
    return sum(value for _, value in families.get(name, []))


async def hold(http: httpx.AsyncClient, model: str, started: asyncio.Event) -> None:
    """A long stream: `started` once its first token came; runs until cancelled."""
    async with http.stream("POST", "/v1/completions",
                           json=body(model, HOLD_TOKENS, stream=True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                started.set()


async def engine_while_held(server: RunningServer, models: tuple[str, ...]) -> tuple[
    Families, float
]:
    """The metrics once all streams run, and the adapter loads counted while they started."""
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as http:
        for model in models:  # loaded now if it is not, so that no stream below waits for it
            response = await http.post("/v1/completions", json=body(model, 2, stream=False))
            assert response.status_code == 200, response.text
        loads = total(await scrape(server), "vllm:lora_adapter_load_seconds_count")
        started = [asyncio.Event() for _ in range(STREAMS)]
        streams = [asyncio.create_task(hold(http, models[i % len(models)], event))
                   for i, event in enumerate(started)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), WAIT_S)
            seen = []
            for _ in range(200):  # the scheduler's numbers arrive with its next step's outputs
                families = await scrape(server)
                seen.append(total(families, "vllm:num_requests_running"))
                if seen[-1] >= STREAMS or any(s.done() for s in streams):
                    break
                await asyncio.sleep(0.05)
        finally:
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    assert seen[-1] >= STREAMS, f"engine running counts seen: {seen}"
    return families, total(families, "vllm:lora_adapter_load_seconds_count") - loads


@pytest.mark.parametrize("models", [("a1", "a2"), ("tiny",)], ids=["two-adapters", "base"])
async def test_requests_for_resident_adapters_run_together_like_base_requests(
    live_server: RunningServer, models: tuple[str, ...]
) -> None:
    families, loads = await engine_while_held(live_server, models)
    assert total(families, "vllm:num_requests_waiting") == 0
    assert loads == 0  # resident adapters: no request waited for a load
    (info, _), = families["vllm:lora_requests_info"]
    running = "" if models == ("tiny",) else ",".join(models)
    assert info["running_lora_adapters"] == running


def sample(families: Families, name: str, adapter: str) -> float:
    return sum(v for labels, v in families.get(name, []) if labels.get("adapter") == adapter)


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll `check` until it holds; the deadline is a safety bound, never the assertion."""
    for _ in range(int(WAIT_S / 0.1)):
        if await check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"never saw: {what}")


async def test_a_third_adapter_waits_for_a_slot_in_the_gateway_and_takes_the_first_that_drains(
    strict_server: RunningServer,
) -> None:
    """maxActiveAdapters 2: long streams on a1 and a2 hold both adapter slots, so a3's
    streams wait in the gateway's queue while the engine runs only a1 and a2; once a1's streams
    end, a3 takes its slot (a rotation) and its streams start beside a2's."""
    async with httpx.AsyncClient(base_url=strict_server.url, timeout=WAIT_S) as http:
        for model in ("a1", "a2", "a3"):
            response = await http.post("/v1/completions", json=body(model, 2, stream=False))
            assert response.status_code == 200, response.text
        before = await scrape(strict_server)
        events = {m: [asyncio.Event(), asyncio.Event()] for m in ("a1", "a2", "a3")}
        tasks = {m: [asyncio.create_task(hold(http, m, e)) for e in es] for m, es in events.items()
                 if m != "a3"}
        try:
            await asyncio.wait_for(asyncio.gather(
                *(e.wait() for m in ("a1", "a2") for e in events[m])), WAIT_S)
            tasks["a3"] = [asyncio.create_task(hold(http, "a3", e)) for e in events["a3"]]

            async def a3_queued() -> bool:
                families = await scrape(strict_server)
                return sample(families, "gateway_adapter_requests_queued", "a3") == 2

            await until(a3_queued, "a3's two streams in the gateway's queue")
            families = await scrape(strict_server)
            (info, _), = families["vllm:lora_requests_info"]
            assert set(info["running_lora_adapters"].split(",")) == {"a1", "a2"}
            assert not any(e.is_set() for e in events["a3"])
            for task in tasks["a1"]:
                task.cancel()
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events["a3"])), WAIT_S)
            after = await scrape(strict_server)
        finally:
            for task in [t for group in tasks.values() for t in group]:
                task.cancel()
            await asyncio.gather(*(t for g in tasks.values() for t in g), return_exceptions=True)
    rotations = "gateway_adapter_rotations_total"
    assert sample(after, rotations, "a3") - sample(before, rotations, "a3") == 1
    waited = "gateway_adapter_queue_wait_seconds_count"
    assert sample(after, waited, "a3") - sample(before, waited, "a3") == 2
    waited_s = "gateway_adapter_queue_wait_seconds_sum"
    assert sample(after, waited_s, "a3") > sample(before, waited_s, "a3")


async def test_a_waiting_adapter_is_loaded_ahead_while_the_slots_are_busy(
    strict_server: RunningServer,
) -> None:
    """maxActiveAdapters 2 below maxCpuLoras 4: while a1 and a2 hold both slots, an adapter that
    is not in the engine and has requests waiting is loaded into a spare cached place (a
    prefetch) before its turn, so when a slot drains its streams start without a load of
    their own."""
    name = "prefetched-a4"
    async with async_management_client(strict_server, timeout=60) as mgmt:
        src = DEMO / "test-adapters" / "a4"
        registered = await mgmt.post("/adapters", params={"name": name, "src": str(src),
                                                    "preload": "false"})
        assert registered.status_code == 200, registered.text
        try:
            assert (await mgmt.get(f"/adapters/{name}")).json()["engineLoaded"] is False
            before = await scrape(strict_server)
            described = await prefetched_while_queued(strict_server, mgmt, name)
        finally:
            await mgmt.delete(f"/adapters/{name}")
    assert described["loads"] == 1 and described["coldLoads"] == 0  # the prefetch, no other
    prefetches = "gateway_adapter_prefetches_total"
    assert sample(described["after"], prefetches, name) - sample(before, prefetches, name) == 1


async def prefetched_while_queued(
    server: RunningServer, mgmt: httpx.AsyncClient, name: str
) -> dict[str, object]:
    """Hold a1 and a2's slots, queue two streams on `name`, see it loaded while they wait, then
    free a slot and see them start; its description and the metrics after."""
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as http:
        for model in ("a1", "a2"):
            response = await http.post("/v1/completions", json=body(model, 2, stream=False))
            assert response.status_code == 200, response.text
        events = {m: [asyncio.Event(), asyncio.Event()] for m in ("a1", "a2", name)}
        tasks = {m: [asyncio.create_task(hold(http, m, e)) for e in events[m]]
                 for m in ("a1", "a2")}
        try:
            await asyncio.wait_for(asyncio.gather(
                *(e.wait() for m in ("a1", "a2") for e in events[m])), WAIT_S)
            tasks[name] = [asyncio.create_task(hold(http, name, e)) for e in events[name]]

            async def loaded_while_queued() -> bool:
                queued = sample(await scrape(server), "gateway_adapter_requests_queued", name)
                engine_loaded = (await mgmt.get(f"/adapters/{name}")).json()["engineLoaded"]
                return queued == 2 and engine_loaded is True

            await until(loaded_while_queued, f"{name} in the engine while its streams wait")
            assert not any(e.is_set() for e in events[name])
            for task in tasks["a1"]:
                task.cancel()
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events[name])), WAIT_S)
            described: dict[str, object] = (await mgmt.get(f"/adapters/{name}")).json()
            described["after"] = await scrape(server)
        finally:
            for task in [t for group in tasks.values() for t in group]:
                task.cancel()
            await asyncio.gather(*(t for g in tasks.values() for t in g), return_exceptions=True)
    return described
