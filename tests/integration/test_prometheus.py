"""The operator's metrics path with the real parts, on the REAL engine behind a metrics listener
that requires client certificates: a real Prometheus (Debian's package) started with
deploy/prometheus.yml as shipped (only ports and file paths changed) scrapes it; every metric
the Grafana dashboard (deploy/grafana-dashboard.json) reads has samples after traffic; and a
real response says the gateway's overhead."""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.dashboard import dashboard_metrics, load, sampled_names
from tests.integration.traffic import management_tls
from tests.serverproc import CERTS, ROOT, RunningServer, free_port, running_server
from tests.tools import debian_tool

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

SCRAPE_JOB = "llm-gateway"  # the shipped job for fixed replicas


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    overrides = {"ServerConfig": {"metricsHttpsEnabled": True}}
    with running_server(tmp_path_factory.mktemp("tls-metrics"), overrides=overrides) as running:
        yield running


@dataclass(frozen=True)
class Traffic:
    answers: dict[str, httpx.Response]
    grpc_trailers: dict[str, str]
    grpc_seconds: float


def grpc_infer(server: RunningServer) -> tuple[dict[str, str], float]:
    """One unary ModelInfer on the gRPC listener: its trailing metadata and duration."""
    request = service_pb2.ModelInferRequest(model_name="tiny")
    for name, value in (("text_input", b"a b c"), ("sampling_parameters",
                                                    json.dumps({"max_tokens": 4}).encode())):
        request.inputs.add(name=name, datatype="BYTES", shape=[1])
        request.raw_input_contents.append(struct.pack("<I", len(value)) + value)
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        started = time.perf_counter()
        _, call = stub.ModelInfer.with_call(request, timeout=120)
        seconds = time.perf_counter() - started
    return {str(k): str(v) for k, v in call.trailing_metadata() or ()}, seconds


@pytest.fixture(scope="module")
def traffic(server: RunningServer) -> Traffic:
    """Every kind of request the dashboard shows: base and adapter, whole and streamed, HTTP
    and gRPC, and a refusal."""
    body = {"prompt": "the operators watch", "max_tokens": 6, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        answers = {
            "base": http.post("/v1/completions", json={**body, "model": "tiny"}),
            "adapter": http.post("/v1/completions", json={**body, "model": "a1"}),
            "stream": http.post("/v1/completions", json={**body, "model": "tiny", "stream": True}),
            "tgi": http.post("/generate", json={"inputs": "a b",
                                                "parameters": {"max_new_tokens": 4}}),
            "unknown": http.post("/v1/completions", json={**body, "model": "nope"}),
        }
    trailers, seconds = grpc_infer(server)
    assert [answers[k].status_code for k in ("base", "adapter", "stream", "tgi")] == [200] * 4
    assert answers["unknown"].status_code == 404
    return Traffic(answers, trailers, seconds)


def scrape(server: RunningServer) -> str:
    response = httpx.get(f"{server.metrics_url}/metrics", verify=management_tls(), timeout=30)
    assert response.status_code == 200
    return response.text


def test_every_metric_of_the_dashboard_has_samples_after_traffic(
    server: RunningServer, traffic: Traffic
) -> None:
    exposed = sampled_names(scrape(server))
    missing = {
        name: sorted(panels)
        for name, panels in dashboard_metrics(load()).items()
        if name not in exposed
    }
    assert not missing


def test_a_real_response_says_the_gateways_overhead(traffic: Traffic) -> None:
    for name, response in traffic.answers.items():
        overhead_ms = float(response.headers["x-gateway-overhead-ms"])
        total_ms = response.elapsed.total_seconds() * 1000
        print(f"{name}: {response.status_code} overhead {overhead_ms:.2f} ms of {total_ms:.1f} ms")
        assert 0.0 <= overhead_ms < total_ms, name
    overhead_ms = float(traffic.grpc_trailers["x-gateway-overhead-ms"])
    print(f"gRPC ModelInfer: overhead {overhead_ms:.2f} ms of {traffic.grpc_seconds * 1000:.1f} ms")
    assert 0.0 <= overhead_ms < traffic.grpc_seconds * 1000


# ---- a real Prometheus --------------------------------------------------------------------------
def prometheus_binary() -> str:
    return debian_tool("prometheus", "prometheus")


def shipped_config(server: RunningServer) -> dict[str, Any]:
    """deploy/prometheus.yml with the dev certificates, this server's metrics port and a 1 s
    scrape interval; everything else as shipped."""
    config: dict[str, Any] = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    job = next(j for j in config["scrape_configs"] if j["job_name"] == SCRAPE_JOB)
    job["tls_config"].update(
        ca_file=str(CERTS / "ca.pem"),
        cert_file=str(CERTS / "client.pem"),
        key_file=str(CERTS / "client.key"),
    )
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{server.metrics_port}"]
    return config


@contextlib.contextmanager
def running_prometheus(config: dict[str, Any], folder: Path) -> Iterator[str]:
    """Prometheus on a free loopback port with its storage in `folder`; yields its URL."""
    binary = prometheus_binary()
    config_path = folder / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    check = subprocess.run([shutil.which("promtool") or "promtool", "check", "config",
                            str(config_path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    address = f"127.0.0.1:{free_port()}"
    log_path = folder / "prometheus.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={config_path}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address={address}", "--storage.tsdb.retention.time=1h"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        yield f"http://{address}"
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    with contextlib.suppress(httpx.HTTPError):
        response = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=10)
        body = response.json()
        if body.get("status") == "success":
            result: list[dict[str, Any]] = body["data"]["result"]
            return result
    return []


def eventually(prometheus: str, promql: str, timeout: float = 90.0) -> list[dict[str, Any]]:
    """The query's result once it is not empty (Prometheus has scraped), within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = query(prometheus, promql)
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"no result for {promql} within {timeout}s")


def test_a_real_prometheus_scrapes_the_mtls_metrics_listener_with_the_shipped_config(
    server: RunningServer, traffic: Traffic, tmp_path: Path
) -> None:
    target = f"127.0.0.1:{server.metrics_port}"
    with running_prometheus(shipped_config(server), tmp_path) as prometheus:
        up = eventually(prometheus, f'up{{job="{SCRAPE_JOB}", instance="{target}"}} == 1')
        assert up[0]["metric"]["service"] == "llm-gateway"  # the shipped target label
        tokens = eventually(prometheus, f'vllm:generation_tokens_total{{job="{SCRAPE_JOB}"}} > 0')
        adapter = eventually(
            prometheus, f'gateway_adapter_requests_total{{job="{SCRAPE_JOB}", adapter="a1"}} >= 1'
        )
    assert float(tokens[0]["value"][1]) >= 6 * 3  # three whole answers of 6 tokens at least
    assert adapter[0]["metric"]["instance"] == target
