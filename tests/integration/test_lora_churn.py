"""LoRA churn on the live server (real vLLM engine, maxLoras 2, maxCpuLoras 4).

- Ten adapters (a1-a3 and a4-a10) hammered concurrently: every request gets its own adapter's
  greedy output (compared with that adapter run alone), while the registry evicts and reloads.
- A pinned adapter survives the churn: never evicted, still in the engine, still correct.
- Unregistering an adapter with a request in flight lets the request finish, then frees it.
- Registering and unregistering while traffic flows loses no request and corrupts no state.
- An adapter's weights changed in place as fast as the management API allows (vLLM's
  `load_inplace` and DJL's update, alternately) while requests on it flow: the engine lives on
  and every answer comes from one whole version of the weights.
Every adapter this module registers is named `churn-*` and unregistered again.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from tests.integration.traffic import async_management_client, management_client
from tests.serverproc import DEMO, RunningServer

PROMPT = "once upon a time the gateway"
TOKENS = 8
CHURN = [f"churn-a{i}" for i in range(4, 11)]  # + a1, a2, a3 already registered = 10 adapters

pytestmark = [pytest.mark.server, pytest.mark.anyio]


def body(adapter: str, **parameters: Any) -> dict[str, Any]:
    return {"inputs": PROMPT, "adapters": adapter,
            "parameters": {"max_new_tokens": TOKENS, **parameters}}


@pytest.fixture(scope="module")
def churn_adapters(live_server: RunningServer) -> Iterator[list[str]]:
    """a1-a3 plus seven more registered lazily (preload=false): ten adapters, two engine slots,
    four cached places."""
    with management_client(live_server, timeout=60) as mgmt:
        for name in CHURN:
            src = DEMO / "test-adapters" / name.removeprefix("churn-")
            response = mgmt.post("/adapters", params={"name": name, "src": str(src),
                                                      "preload": "false"})
            assert response.status_code == 200, response.text
        try:
            yield ["a1", "a2", "a3", *CHURN]
        finally:
            for name in CHURN:
                mgmt.delete(f"/adapters/{name}")


@pytest.fixture(scope="module")
def alone(live_server: RunningServer, churn_adapters: list[str]) -> dict[str, str]:
    """Each adapter's (and the base model's) greedy output, run one request at a time."""
    with httpx.Client(base_url=live_server.url, timeout=60) as data:
        texts = {}
        for name in ["", *churn_adapters]:
            response = data.post("/invocations", json=body(name))
            assert response.status_code == 200, response.text
            texts[name] = response.json()["generated_text"]
    assert len(set(texts.values())) == len(texts)  # every adapter differs from the others
    return texts


@pytest.fixture
async def data(live_server: RunningServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=live_server.url, timeout=120) as http:
        yield http


async def run_all(data: httpx.AsyncClient, names: list[str], limit: int) -> list[str]:
    gate = asyncio.Semaphore(limit)

    async def one(name: str) -> str:
        async with gate:
            response = await data.post("/invocations", json=body(name))
            assert response.status_code == 200, response.text
            text: str = response.json()["generated_text"]
            return text

    return list(await asyncio.gather(*(one(n) for n in names)))


def describe(mgmt: httpx.Client, name: str) -> dict[str, Any]:
    described: dict[str, Any] = mgmt.get(f"/adapters/{name}").json()
    return described


async def test_ten_adapter_churn_gives_every_request_its_own_adapter_output(
    live_server: RunningServer, data: httpx.AsyncClient, churn_adapters: list[str],
    alone: dict[str, str],
) -> None:
    names = ["", *churn_adapters] * 4
    random.Random(3).shuffle(names)
    with management_client(live_server, timeout=60) as mgmt:
        before = {n: describe(mgmt, n) for n in churn_adapters}
        outputs = await run_all(data, names, limit=12)
        after = {n: describe(mgmt, n) for n in churn_adapters}
    assert outputs == [alone[n] for n in names]
    evicted = sum(after[n]["evictions"] - before[n]["evictions"] for n in churn_adapters)
    assert evicted > 0  # the cache really churned
    resident = [n for n in churn_adapters if after[n]["engineLoaded"]]
    assert len(resident) <= 4  # maxCpuLoras
    # the engine holds exactly what the registry loaded: it never evicted on its own (a load
    # sent before the removal it replaces would have made vLLM's LRU pick a victim)
    assert resident == [n for n in churn_adapters if after[n]["residency"] != "registered"]


async def test_pinned_adapter_survives_churn(
    live_server: RunningServer, data: httpx.AsyncClient, churn_adapters: list[str],
    alone: dict[str, str],
) -> None:
    pinned = "churn-a4"
    with management_client(live_server, timeout=60) as mgmt:
        assert mgmt.post(f"/adapters/{pinned}/update", params={"pin": "true"}).status_code == 200
        try:
            start = describe(mgmt, pinned)
            assert start["engineLoaded"] and start["pin"]
            names = [n for n in churn_adapters if n != pinned] * 3 + [pinned] * 3
            random.Random(5).shuffle(names)
            outputs = await run_all(data, names, limit=10)
            end = describe(mgmt, pinned)
        finally:
            mgmt.post(f"/adapters/{pinned}/update", params={"pin": "false"})
    assert outputs == [alone[n] for n in names]
    assert end["evictions"] == start["evictions"]
    assert end["loads"] == start["loads"]
    assert end["engineLoaded"] is True


async def test_unregister_with_a_request_in_flight_lets_it_finish(
    live_server: RunningServer, data: httpx.AsyncClient,
) -> None:
    name, src = "churn-inflight", DEMO / "test-adapters" / "a11"
    long = {"inputs": PROMPT, "adapters": name, "stream": True,
            "parameters": {"max_new_tokens": 200, "ignore_eos_token": True, "details": True}}
    async with async_management_client(live_server, timeout=60) as mgmt:
        created = await mgmt.post("/adapters", params={"name": name, "src": str(src)})
        assert created.status_code == 200
        lines: list[dict[str, Any]] = []
        async with data.stream("POST", "/invocations", json=long) as response:
            stream = response.aiter_lines()
            lines.append(json.loads(await anext(stream)))  # the request is running now
            deleted = await mgmt.delete(f"/adapters/{name}")
            assert deleted.status_code == 200
            lines += [json.loads(line) async for line in stream if line]
        assert lines[-1]["details"]["finish_reason"] == "length"
        assert lines[-1]["details"]["generated_tokens"] == 200 == len(lines)
        refused = await data.post("/invocations", json=body(name))
        assert refused.status_code == 424
        # The adapter leaves the engine once it settled after its last request (two engine
        # steps, or settle_s, 0.25 s, when nothing else runs, as here): vLLM may still run it
        # in a step it had already scheduled.
        await asyncio.sleep(1.0)
        # Same name and source get the same LoRA id back: the engine no longer holds it.
        again = await mgmt.post("/adapters", params={"name": name, "src": str(src),
                                                     "preload": "false"})
        assert again.status_code == 200
        try:
            assert (await mgmt.get(f"/adapters/{name}")).json()["engineLoaded"] is False
        finally:
            await mgmt.delete(f"/adapters/{name}")


async def test_register_and_unregister_while_traffic_flows_lose_nothing(
    live_server: RunningServer, data: httpx.AsyncClient, alone: dict[str, str],
) -> None:
    flux = {"churn-flux-a": "a12", "churn-flux-b": "a11"}
    stable = ["", "a1", "a2", "a3"]
    expected = dict(alone)
    outcomes: list[tuple[str, int, str]] = []
    stop = asyncio.Event()
    async with async_management_client(live_server, timeout=60) as mgmt:
        for name, src in flux.items():  # each flux adapter's own output, for comparison
            await mgmt.post("/adapters", params={"name": name, "src": str(
                DEMO / "test-adapters" / src)})
            expected[name] = (await data.post("/invocations", json=body(name))).json()[
                "generated_text"]
            await mgmt.delete(f"/adapters/{name}")

        async def traffic(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                name = rng.choice([*stable, *flux])
                response = await data.post("/invocations", json=body(name))
                ok = response.status_code == 200
                outcomes.append((name, response.status_code,
                                 response.json()["generated_text"] if ok else ""))

        async def churn() -> None:
            rng = random.Random(11)
            for _ in range(24):
                name = rng.choice(list(flux))
                await mgmt.post("/adapters", params={"name": name, "src": str(
                    DEMO / "test-adapters" / flux[name]), "preload": rng.choice(["true", "false"])})
                await asyncio.sleep(rng.random() / 20)
                await mgmt.delete(f"/adapters/{name}")
            stop.set()

        await asyncio.gather(churn(), *(traffic(seed) for seed in range(6)))
        listed = [a["name"] for a in (await mgmt.get("/adapters")).json()["adapters"]]
    assert len(outcomes) > 24
    for name, status, text in outcomes:
        if name in stable:
            assert (status, text) == (200, expected[name])
        else:
            assert status in (200, 424)
            assert status == 424 or text == expected[name]
    assert any(n in flux and s == 200 for n, s, _ in outcomes)  # the flux adapters did serve
    assert not set(flux) & set(listed)
    for name in stable:
        response = await data.post("/invocations", json=body(name))
        assert response.json()["generated_text"] == alone[name]


async def test_weights_changed_in_place_at_full_speed_keep_the_engine_alive(
    live_server: RunningServer, data: httpx.AsyncClient, alone: dict[str, str],
) -> None:
    """Every change gives the adapter a new engine identity while requests of the old one still
    run: a step then holds two ids under one name, which vLLM's worker once took for one adapter
    (it killed the engine within seconds, with changes 0.02 s apart)."""
    name, versions, changes = "churn-hot", CHURN, 200
    statuses: list[int] = []
    wrong: list[str] = []
    expected = {alone[v] for v in versions}
    stop = asyncio.Event()

    def src(index: int) -> str:
        return str(DEMO / "test-adapters" / versions[index % len(versions)].removeprefix("churn-"))

    async def traffic() -> None:
        while not stop.is_set():
            response = await data.post("/invocations", json=body(name))
            statuses.append(response.status_code)
            if response.status_code == 200 and response.json()["generated_text"] not in expected:
                wrong.append(response.text)

    async with async_management_client(live_server, timeout=60) as mgmt:
        loaded = await mgmt.post("/v1/load_lora_adapter",
                                 json={"lora_name": name, "lora_path": src(0)})
        assert loaded.status_code == 200, loaded.text

        async def churn() -> list[int]:
            answers = []
            try:
                for index in range(1, changes + 1):
                    if index % 2:
                        response = await mgmt.post("/v1/load_lora_adapter", json={
                            "lora_name": name, "lora_path": src(index), "load_inplace": True})
                    else:
                        response = await mgmt.post(f"/models/tiny/adapters/{name}/update",
                                                   params={"src": src(index)})
                    answers.append(response.status_code)
                    await asyncio.sleep(0.02)
            finally:
                stop.set()
            return answers

        try:
            answers, *_ = await asyncio.gather(churn(), *(traffic() for _ in range(8)))
            final = await data.post("/invocations", json=body(name))
        finally:
            await mgmt.delete(f"/adapters/{name}")
    assert answers == [200] * changes
    assert len(statuses) > 8 and set(statuses) == {200}
    assert wrong == []
    assert final.json()["generated_text"] == alone[versions[changes % len(versions)]]
    assert (await data.get("/health")).status_code == 200
    for other in ["", "a1"]:  # the engine still answers everything else as before
        response = await data.post("/invocations", json=body(other))
        assert response.json()["generated_text"] == alone[other]
