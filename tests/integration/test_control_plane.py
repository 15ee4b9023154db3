"""The control router through real sockets: the management listener (mTLS) of the shared server
on the REAL engine, and one fake-engine server whose engine dies, for the FAILED state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.dev.healthcheck import main as probe_main
from tests.integration.traffic import async_management_client, management_client
from tests.serverproc import CERTS, RunningServer, free_port, running_server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def management(live_server: RunningServer) -> Iterator[httpx.Client]:
    with management_client(live_server, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def data(live_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=60) as client:
        yield client


def completion(data: httpx.Client, tokens: int = 4) -> httpx.Response:
    return data.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": tokens}
    )


def health_probes(server: RunningServer) -> float:
    text = httpx.get(f"{server.metrics_url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "gateway_generation_requests":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels["protocol"] == "health":
                    return s.value
    return 0.0


def test_management_health_family_is_up(management: httpx.Client) -> None:
    for path in ("/v2/health/live", "/v2/health/ready", "/health", "/v2/models/tiny/ready"):
        response = management.get(path)
        assert (response.status_code, response.content) == (200, b""), path
    missing = management.get("/v2/models/not-served/ready")
    assert missing.status_code == 404
    assert missing.json() == {"error": "Model not-served not found.", "error_type": "NotFoundError"}


def engine_requests(server: RunningServer) -> float:
    """The engine's own count of finished requests (vLLM's `vllm:request_success`)."""
    text = httpx.get(f"{server.metrics_url}/metrics", timeout=30).text
    return sum(
        s.value for family in text_string_to_metric_families(text)
        if family.name == "vllm:request_success"
        for s in family.samples if s.name.endswith("_total")
    )


def test_timed_health_runs_one_real_generation(
    live_server: RunningServer, management: httpx.Client
) -> None:
    before = health_probes(live_server)
    response = management.get("/health/timed-10")
    assert (response.status_code, response.json()) == (200, {"status": "healthy"})
    # a second probe right after reuses the fresh result (protocols/mindie/probe.py)
    assert management.get("/health/timed").status_code == 200
    assert health_probes(live_server) == before + 1


def test_concurrent_timed_probes_make_the_engine_run_one_generation(
    live_server: RunningServer,
) -> None:
    """The open probe cannot be used to load the engine: 24 callers at once, one generation."""

    async def probe_all() -> list[httpx.Response]:
        async with async_management_client(live_server, timeout=60) as http:
            return await asyncio.gather(*[http.get("/health/timed-30") for _ in range(24)])

    time.sleep(1.1)  # let any earlier probe's result go stale: this burst must run one
    before, probes_before = engine_requests(live_server), health_probes(live_server)
    answers = asyncio.run(probe_all())
    assert [a.status_code for a in answers] == [200] * 24
    assert health_probes(live_server) == probes_before + 1
    seen = engine_requests(live_server)
    deadline = time.monotonic() + 30  # vLLM's stats land with the engine's next step
    while seen < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        seen = engine_requests(live_server)
    assert seen == before + 1


@pytest.mark.parametrize("suffix", ["-0", "-1000", "-601", "-abc", "--1", "-1.5"])
def test_timed_health_bad_wait_is_404_and_runs_nothing(
    live_server: RunningServer, management: httpx.Client, suffix: str
) -> None:
    before = health_probes(live_server)
    response = management.get(f"/health/timed{suffix}")
    assert response.status_code == 404
    assert response.json()["error_type"] == "NotFoundError"
    assert health_probes(live_server) == before


def test_slot_count_and_status_report_the_real_engine(management: httpx.Client) -> None:
    slots = management.get("/v2/models/tiny/getSlotCount").json()
    assert slots["total_slots"] == 32  # ModelConfig.maxNumSeqs
    assert 0 <= slots["free_slots"] <= 32
    assert slots["available_tokens_length"] > 0
    v1 = management.get("/v1/status").json()
    v2 = management.get("/v2/status").json()
    assert v1["service"]["roleStatus"] == "RoleReady"
    assert v1["resource"]["totalNpuBlockNums"] > 0
    assert v1["gateway"]["state"] == "ready"
    assert {"a1", "a2", "a3"} <= set(v1["gateway"]["adapters"])
    assert v2["resource"]["dpInstMap"] == {"0": v2["resource"]["totalAvailNpuBlockNum"]}


def test_config_has_mindie_fields_from_the_engine(management: httpx.Client) -> None:
    config = management.get("/v1/config").json()
    assert config["modelName"] == "tiny"
    assert config["maxSeqLen"] == 512
    assert config["worldSize"] == 1
    assert config["cacheBlockSize"] > 0
    assert config["settings"]["ServerConfig"]["managementHttpsEnabled"] is True


def test_role_decode_refuses_clients_in_their_protocol_then_flex_serves(
    management: httpx.Client, data: httpx.Client
) -> None:
    try:
        assert management.post("/v1/role/decode", json={}).json() == {"result": "ok"}
        assert management.get("/v1/status").json()["service"]["currentRole"] == "decode"
        refused = completion(data)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == 503
        assert "retry-after" in refused.headers
        tgi = data.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}})
        assert (tgi.status_code, tgi.json()["error_type"]) == (503, "unhealthy")
    finally:
        assert management.post("/v2/role/prefill").status_code == 200
        assert management.post("/v1/role/flex").status_code == 200
    assert completion(data).status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/v1/role/primary", None, 404),
        ("POST", "/v2/role/flex", None, 404),
        ("POST", "/v1/role/prefill", b"{oops", 422),
        ("POST", "/v2/role/decode", b'{"local": {"id": 1}}', 422),
        ("GET", "/v1/role/prefill", None, 405),
        ("POST", "/stopService", None, 405),
        ("DELETE", "/v1/config", None, 405),
        ("PUT", "/v2/status", None, 405),
        ("GET", "/stopService?mode=Later", None, 400),
        ("GET", "/v3/status", None, 404),
    ],
)
def test_bad_control_input_is_a_clear_4xx_and_the_server_keeps_serving(
    management: httpx.Client,
    data: httpx.Client,
    method: str,
    path: str,
    body: bytes | None,
    status: int,
) -> None:
    response = management.request(method, path, content=body)
    assert response.status_code == status
    assert set(response.json()) == {"error", "error_type"}
    assert management.get("/v1/status").json()["service"]["currentRole"] == "flex"
    assert completion(data).status_code == 200


def test_metrics_routes_are_also_on_the_management_listener(management: httpx.Client) -> None:
    assert management.get("/metrics-json").json()["resultType"] == "vector"
    assert "gateway_http_requests_total" in management.get("/metrics").text


# ---- an engine that dies (fake engine, its own process) ----------------------------------------
def wait_for(check: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def healthcheck(server: RunningServer, *extra: str) -> int:
    args = [
        "--url",
        f"{server.management_url}/v2/health/live",
        "--ca",
        str(CERTS / "ca.pem"),
        "--cert",
        str(CERTS / "client.pem"),
        "--key",
        str(CERTS / "client.key"),
        *extra,
    ]
    return probe_main(args)


def test_dead_engine_turns_every_health_route_and_request_away(tmp_path: Path) -> None:
    flag = tmp_path / "engine-dead"
    overrides = {
        "ModelConfig": {"engineOptions": {"dead_flag_path": str(flag)}},
        "LimitsConfig": {"engineCheckInterval": 0.1},
    }
    with running_server(tmp_path, engine="fake", overrides=overrides) as server:
        with (
            management_client(server, timeout=30) as management,
            httpx.Client(base_url=server.url, timeout=30) as data,
        ):
            assert management.get("/v2/health/live").status_code == 200
            assert healthcheck(server) == 0  # the container probe, with the client certificate
            assert healthcheck(server, "--cert", "") == 1  # mTLS: no certificate, no answer
            flag.touch()
            wait_for(lambda: management.get("/v2/health/live").status_code == 500)
            live = management.get("/v2/health/live").json()
            assert live["message"].startswith("Service is abnormal")
            assert management.get("/v2/health/ready").status_code == 500
            assert management.get("/health").status_code == 500
            assert management.get("/v1/status").status_code == 503
            assert management.get("/health/timed-5").status_code == 503
            assert data.get("/health").status_code == 503  # TGI's readiness on the data port
            assert completion(data).status_code == 503
            metrics = httpx.get(f"{server.metrics_url}/metrics").text
            assert 'gateway_lifecycle_state{state="failed"} 1.0' in metrics
            assert healthcheck(server) == 1
        assert server.stop() == 1  # a failed engine is not a clean exit


def test_one_shared_port_serves_data_control_and_metrics(tmp_path: Path) -> None:
    """MindIE lets the three listeners share an address: one socket then serves all routes,
    each protocol keeping its own health shape."""
    port = free_port()
    overrides = {
        "ServerConfig": {
            "port": port,
            "managementPort": port,
            "metricsPort": port,
            "managementHttpsEnabled": False,
        }
    }
    with running_server(tmp_path, engine="fake", overrides=overrides) as server:
        assert server.management_port == server.data_port == server.metrics_port
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/v1/status").json()["gateway"]["state"] == "ready"
            assert "gateway_http_requests_total" in http.get("/metrics").text
            assert completion(http).status_code == 200
            assert http.get("/health").content == b""  # TGI's /health, not MindIE's
            assert http.get("/health/timed-5").json() == {"status": "healthy"}
        log = server.log()
    assert log.count("start-up listeners: ") == 1 and "Uvicorn running on" not in log
