"""/metrics and /metrics-json through real sockets: vLLM's own families from the REAL engine,
gateway counters that move by exactly the requests made, and MindIE's JSON numbers checked
against what the client measured (fake engine with a fixed token delay, its own process)."""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.traffic import management_client, sse_payloads
from tests.serverproc import CERTS, RunningServer, running_server

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(server: RunningServer) -> tuple[Samples, set[str]]:
    response = httpx.get(f"{server.metrics_url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    families = set()
    for family in text_string_to_metric_families(response.text):
        families.add(family.name)
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, families


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def vllm_total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


@pytest.fixture(scope="module")
def data(live_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=60) as client:
        yield client


@pytest.mark.server
def test_metrics_expose_vllm_families_from_the_engine(live_server: RunningServer) -> None:
    _, families = scrape(live_server)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:generation_tokens",
        "vllm:prompt_tokens",
        "vllm:request_success",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert name in families, name
    for name in ("gateway_http_requests", "gateway_lifecycle_state", "gateway_adapters_loaded"):
        assert name in families, name


@pytest.mark.server
def test_counters_move_by_exactly_the_requests_made(
    live_server: RunningServer, data: httpx.Client
) -> None:
    before, _ = scrape(live_server)
    ok = [
        data.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "count me", "max_tokens": 7, "ignore_eos": True},
        )
        for _ in range(3)
    ]
    missing = data.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
    stream = data.post(
        "/generate_stream",
        json={
            "inputs": "count me too",
            "parameters": {"max_new_tokens": 5, "details": True},
        },
    )
    bad_json = data.post(
        "/generate", content=b"{broken", headers={"content-type": "application/json"}
    )
    assert [r.status_code for r in ok] == [200, 200, 200]
    assert (missing.status_code, stream.status_code, bad_json.status_code) == (404, 200, 422)
    tgi_tokens = json.loads(sse_payloads(stream.text)[-1])["details"]["generated_tokens"]
    after, _ = scrape(live_server)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    http = "gateway_http_requests_total"
    assert moved(http, protocol="openai", endpoint="/v1/completions", status="200") == 3
    assert moved(http, protocol="openai", endpoint="/v1/completions", status="404") == 1
    assert moved(http, protocol="tgi", endpoint="/generate_stream", status="200") == 1
    assert moved(http, protocol="tgi", endpoint="/generate", status="422") == 1
    assert moved("gateway_generation_requests_total", protocol="openai") == 3
    assert moved("gateway_generation_requests_total", protocol="tgi") == 1
    assert moved("gateway_generation_tokens_total", protocol="openai") == 3 * 7
    assert moved("gateway_generation_tokens_total", protocol="tgi") == tgi_tokens
    assert (
        moved("gateway_request_failures_total", protocol="openai", error_type="model_not_found")
        == 1
    )
    assert moved("gateway_time_to_first_token_seconds_count", protocol="openai") == 3
    assert moved("gateway_inter_token_latency_seconds_count", protocol="openai") == 3 * 6
    assert moved("gateway_e2e_request_latency_seconds_count", protocol="tgi") == 1
    assert value(after, "gateway_requests_inflight", protocol="openai") == 0
    # vLLM's own counter saw the same tokens (its stats land with the engine's next step).
    expected = 3 * 7 + tgi_tokens
    deadline = time.monotonic() + 10
    while True:
        seen = vllm_total(after, "vllm:generation_tokens_total") - vllm_total(
            before, "vllm:generation_tokens_total"
        )
        if seen >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.1)
        after, _ = scrape(live_server)
    assert seen == expected


@pytest.mark.server
def test_metrics_json_matches_the_status_of_an_idle_engine(live_server: RunningServer) -> None:
    with management_client(live_server, timeout=30) as management:
        status = management.get("/v1/status").json()["resource"]
    body = httpx.get(f"{live_server.metrics_url}/metrics-json", timeout=30).json()
    values = {item["metric"][0]["__name__"]: int(item["value"]) for item in body["result"]}
    assert values["processingInferRequestNum"] == status["runningRequestNum"] == 0
    assert values["waitingInferRequestNum"] == status["waitingRequestNum"] == 0
    assert values["remainBlocks"] == status["availBlockNum"] == status["totalNpuBlockNums"]
    assert values["TTFT"] >= 0 and values["TBT"] >= 0


# ---- /metrics-json against client measurements (fake engine, fixed token delay) ---------------
DELAY_S = 0.02
SLOW = {
    "ModelConfig": {"engineOptions": {"token_delay_s": DELAY_S}},
    "LimitsConfig": {"maxConcurrentRequests": 2, "maxQueue": 8},
}


async def timed_stream(http: httpx.AsyncClient, tokens: int) -> tuple[float, list[float]]:
    """Client-side TTFT and the gaps between later tokens of one TGI stream."""
    started = time.perf_counter()
    stamps: list[float] = []
    body = {"inputs": "a b c", "parameters": {"max_new_tokens": tokens}}
    async with http.stream("POST", "/generate_stream", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - started, gaps


def metrics_json(server: RunningServer) -> dict[str, int]:
    body = httpx.get(f"{server.metrics_url}/metrics-json", timeout=30).json()
    return {item["metric"][0]["__name__"]: int(item["value"]) for item in body["result"]}


async def until_queued(server: RunningServer, waiting: int) -> dict[str, int]:
    while True:
        values = await asyncio.to_thread(metrics_json, server)
        if values["waitingInferRequestNum"] == waiting:
            return values


@pytest.mark.anyio
async def test_metrics_json_agrees_with_client_measurements(tmp_path: Path) -> None:
    with running_server(tmp_path, engine="fake", overrides=SLOW) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            measured = [await timed_stream(http, 10) for _ in range(4)]
            client_ttft_ms = max(t for t, _ in measured) * 1000
            gaps = [g for _, request_gaps in measured for g in request_gaps]
            client_tbt_ms = sum(gaps) / len(gaps) * 1000
            idle = metrics_json(server)
            load = [asyncio.create_task(timed_stream(http, 30)) for _ in range(5)]
            busy = await asyncio.wait_for(until_queued(server, 3), 30)
            await asyncio.gather(*load)
    assert 0 <= idle["TTFT"] <= client_ttft_ms
    assert abs(idle["TBT"] - client_tbt_ms) <= max(5.0, 0.3 * client_tbt_ms)
    assert idle["TBT"] >= DELAY_S * 1000 * 0.9
    assert (idle["processingInferRequestNum"], idle["waitingInferRequestNum"]) == (0, 0)
    assert busy["processingInferRequestNum"] == 2  # maxConcurrentRequests
    assert busy["remainBlocks"] == 1024


def test_the_example_prometheus_scrape_config_works_with_a_mtls_metrics_listener(
    tmp_path: Path, repo_root: Path
) -> None:
    """deploy/prometheus.yml's TLS settings (dev certificates in place of the mounted ones)
    scrape a metrics listener that requires client certificates; without one, no metrics."""
    config = yaml.safe_load((repo_root / "deploy" / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    tls = job["tls_config"]
    assert job["scheme"] == "https" and job["metrics_path"] == "/metrics"
    assert tls["server_name"] == "localhost"  # the dev server certificate's name
    overrides = {"ServerConfig": {"metricsHttpsEnabled": True}}
    with running_server(tmp_path, engine="fake", overrides=overrides) as server:
        url = f"https://127.0.0.1:{server.metrics_port}{job['metrics_path']}"
        context = ssl.create_default_context(cafile=str(CERTS / "ca.pem"))
        context.load_cert_chain(str(CERTS / "client.pem"), str(CERTS / "client.key"))
        response = httpx.get(url, verify=context, timeout=30)
        assert response.status_code == 200
        names = {f.name for f in text_string_to_metric_families(response.text)}
        assert "gateway_http_requests" in names
        anonymous = ssl.create_default_context(cafile=str(CERTS / "ca.pem"))
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, verify=anonymous, timeout=30)
