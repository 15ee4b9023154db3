"""Fairness across adapters in the admission queue, on a real server process with the real vLLM
engine and 2 admission slots: a backlog of one hot adapter's requests does not hold back the
requests of other adapters (and without `fairAdmission` it does)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serverproc import RunningServer, running_server

HOT = 20  # requests on a1, sent at once: 2 run, 18 queue
COLD = ("a2", "tiny")  # another adapter and the base model, sent once the backlog is there


@pytest.fixture(scope="module", params=[True, False], ids=["fair", "fifo"])
def two_slots(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    overrides = {
        "LimitsConfig": {
            "maxConcurrentRequests": 2, "maxQueue": 64, "fairAdmission": request.param,
        }
    }
    folder = tmp_path_factory.mktemp("fairness")
    with running_server(folder, overrides=overrides) as server:
        yield server


async def queued_on(metrics: httpx.AsyncClient, adapter: str) -> float:
    text = (await metrics.get("/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gateway_adapter_requests_queued" and sample.labels["adapter"] == adapter
    )


async def finishing_order(server: RunningServer) -> list[str]:
    """Send the hot backlog, wait until the gauge shows it queued, send the cold requests;
    return every request's name in the order its answer came back."""
    order: list[str] = []
    limits = httpx.Limits(max_connections=HOT + len(COLD))
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http,
        httpx.AsyncClient(base_url=server.metrics_url, timeout=30) as metrics,
    ):

        async def complete(name: str, model: str) -> None:
            body = {"model": model, "prompt": f"fair share {name}", "max_tokens": 48,
                    "ignore_eos": True, "temperature": 0}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 48
            order.append(name)

        hot = [asyncio.create_task(complete(f"hot{i}", "a1")) for i in range(HOT)]
        while await queued_on(metrics, "a1") < HOT - 4:  # noqa: ASYNC110 (polls the server)
            await asyncio.sleep(0.02)
        cold = [asyncio.create_task(complete(model, model)) for model in COLD]
        await asyncio.gather(*hot, *cold)
        assert await queued_on(metrics, "a1") == 0
    return order


def test_requests_of_other_adapters_are_not_held_behind_a_hot_backlog(
    two_slots: RunningServer,
) -> None:
    order = asyncio.run(finishing_order(two_slots))
    places = [order.index(name) for name in COLD]
    if two_slots.config["LimitsConfig"]["fairAdmission"]:
        # each takes its turn after at most two more hot grants: most of the backlog is behind
        assert max(places) < HOT // 2, order
    else:
        assert min(places) >= HOT - 4, order  # one FIFO: they run after the whole backlog
