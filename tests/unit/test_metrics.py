"""GatewayMetrics, the HTTP middleware and the metrics routes, in process on the fake engine."""

from __future__ import annotations

from bisect import bisect_left

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from server.core.errors import ServiceUnavailable
from server.core.stream import Timing
from server.core.types import GenerationRequest, Sampling, TextPrompt, Usage
from server.engines.fake import FakeScript
from server.observability.families import Observations
from server.observability.metrics import MovingAverage, error_types
from tests.unit.gateway_kit import client, make_gateway

pytestmark = pytest.mark.anyio


def request(protocol: str = "tgi", *, model: str = "", tokens: int = 5) -> GenerationRequest:
    return GenerationRequest(
        request_id="m",
        model=model,
        prompt=TextPrompt("one two three"),
        sampling=Sampling(max_new_tokens=tokens),
        protocol=protocol,
    )


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_protocol_labels_are_a_closed_set() -> None:
    metrics = make_gateway().metrics
    assert [metrics.label(p) for p in ("openai", "kserve", "tgi", "health")] == [
        "openai", "kserve", "tgi", "health",
    ]
    assert metrics.label("../etc/passwd") == "other"
    assert metrics.label("openai_v1") == "other"  # labels are the registry's spec names
    assert {"invalid_request", "model_not_found", "unavailable", "aborted"} <= error_types()


def test_moving_average_keeps_only_the_window() -> None:
    window = MovingAverage(3)
    assert window.mean == 0.0
    for value in (10.0, 1.0, 2.0, 3.0):
        window.add(value)
    assert len(window) == 3
    assert window.mean == pytest.approx(2.0)


async def test_a_generation_moves_every_request_metric_once() -> None:
    gateway = make_gateway()
    registry = gateway.metrics.registry
    result = await gateway.service.generate(request("tgi", tokens=5))
    assert result.usage.completion_tokens == 5
    assert sample(registry, "gateway_generation_requests_total", protocol="tgi") == 1
    assert sample(registry, "gateway_prompt_tokens_total", protocol="tgi") == 3
    assert sample(registry, "gateway_generation_tokens_total", protocol="tgi") == 5
    assert sample(registry, "gateway_time_to_first_token_seconds_count", protocol="tgi") == 1
    assert sample(registry, "gateway_inter_token_latency_seconds_count", protocol="tgi") == 4
    assert sample(registry, "gateway_e2e_request_latency_seconds_count", protocol="tgi") == 1
    assert sample(registry, "gateway_requests_inflight", protocol="tgi") == 0
    assert len(gateway.metrics.ttft_window) == len(gateway.metrics.tbt_window) == 1


async def test_refusals_and_failures_count_by_error_type() -> None:
    gateway = make_gateway(FakeScript(fail_after=2))
    registry = gateway.metrics.registry
    with pytest.raises(Exception, match="does not exist"):
        await gateway.service.generate(request("openai", model="nope"))
    with pytest.raises(Exception, match="scripted failure"):
        await gateway.service.generate(request("openai"))
    gateway.lifecycle.begin_drain()
    with pytest.raises(ServiceUnavailable):
        await gateway.service.generate(request("weird-protocol"))
    failures = "gateway_request_failures_total"
    assert sample(registry, failures, protocol="openai", error_type="model_not_found") == 1
    assert sample(registry, failures, protocol="openai", error_type="generation") == 1
    assert sample(registry, failures, protocol="other", error_type="unavailable") == 1
    assert sample(registry, "gateway_requests_inflight", protocol="openai") == 0


def test_unknown_error_types_collapse_to_other() -> None:
    metrics = make_gateway().metrics
    metrics.rejected(request(), "made-up")
    assert (
        sample(
            metrics.registry, "gateway_request_failures_total", protocol="tgi", error_type="other"
        )
        == 1
    )


async def test_metrics_text_parses_and_has_the_gateway_and_process_families() -> None:
    gateway = make_gateway()
    await gateway.service.generate(request())
    async with client(gateway, "metrics") as http:
        response = await http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name in (
        "gateway_http_requests",
        "gateway_generation_requests",
        "gateway_request_failures",
        "gateway_requests_inflight",
        "gateway_requests_queued",
        "gateway_time_to_first_token_seconds",
        "gateway_inter_token_latency_seconds",
        "gateway_e2e_request_latency_seconds",
        "gateway_prompt_tokens",
        "gateway_generation_tokens",
        "gateway_lifecycle_state",
        "gateway_role",
        "gateway_adapters_loaded",
    ):
        assert name in families, name
    assert any(name.startswith(("python_", "process_")) for name in families)  # default registry
    states = {s.labels["state"]: s.value for s in families["gateway_lifecycle_state"].samples}
    assert states["ready"] == 1 and sum(states.values()) == 1


async def test_http_counter_labels_route_templates_not_raw_paths() -> None:
    gateway = make_gateway()
    async with client(gateway) as http:
        await http.get("/v2/models/some-model-0001/ready")
        await http.get("/v2/models/some-model-0002/ready")
        await http.get("/no/such/route/12345")
    registry = gateway.metrics.registry
    name = "gateway_http_requests_total"
    assert (
        sample(
            registry, name, protocol="control", endpoint="/v2/models/{model}/ready", status="404"
        )
        == 2
    )
    assert sample(registry, name, protocol="other", endpoint="unmatched", status="404") == 1
    endpoints = {
        s.labels["endpoint"]
        for family in registry.collect()
        for s in family.samples
        if s.name == name
    }
    assert not any("some-model" in e or "12345" in e for e in endpoints)


async def test_body_dispatched_paths_count_under_the_chosen_protocol() -> None:
    gateway = make_gateway()
    async with client(gateway, "data") as http:
        mindie = await http.post("/generate", json={"prompt": "one two", "max_tokens": 2})
        tgi = await http.post("/generate", json={"inputs": "one two"})
    registry = gateway.metrics.registry
    name = "gateway_http_requests_total"
    assert (
        sample(
            registry, name, protocol="mindie", endpoint="/generate", status=str(mindie.status_code)
        )
        == 1
    )
    assert (
        sample(registry, name, protocol="tgi", endpoint="/generate", status=str(tgi.status_code))
        == 1
    )


async def test_metrics_json_has_mindie_shape_and_window_means_in_ms() -> None:
    gateway = make_gateway()
    gateway.metrics.finished(
        request(),
        error_type=None,
        usage=Usage(prompt_tokens=3, completion_tokens=3),
        timing=Timing(seconds=1.0, first_token_s=0.100, mean_token_gap_s=0.020),
    )
    gateway.metrics.finished(
        request(),
        error_type=None,
        usage=Usage(prompt_tokens=3, completion_tokens=3),
        timing=Timing(seconds=1.0, first_token_s=0.300, mean_token_gap_s=0.040),
    )
    async with client(gateway, "metrics") as http:
        body = (await http.get("/metrics-json")).json()
    assert body["resultType"] == "vector"
    values = {}
    for item in body["result"]:
        (metric,) = item["metric"]
        assert metric["job"] == "node" and metric["instance"].endswith(":1026")
        assert isinstance(item["value"], str)
        values[metric["__name__"]] = int(item["value"])
    assert values == {
        "TTFT": 200,
        "TBT": 30,
        "waitingInferRequestNum": 0,
        "processingInferRequestNum": 0,
        "remainBlocks": 1024,
    }


async def test_metrics_json_is_503_while_draining_but_metrics_keep_serving() -> None:
    gateway = make_gateway()
    gateway.shutdown.request()
    async with client(gateway, "metrics") as http:
        assert (await http.get("/metrics-json")).status_code == 503
        text = (await http.get("/metrics")).text
    assert 'gateway_lifecycle_state{state="draining"} 1.0' in text


def test_observe_each_counts_runs_of_equal_values_as_one_by_one() -> None:
    bounds = (0.001, 0.01, 0.1, 1.0)
    values = [0.03] * 15 + [0.0005, 0.1, 0.1, 2.0, 0.03, 0.1000001] + [0.007] * 4
    histogram = Observations(bounds)
    histogram.observe_each(values)
    counts, total = [0] * (len(bounds) + 1), 0.0
    for value in values:
        counts[bisect_left(bounds, value)] += 1
        total += value
    assert histogram.counts == counts
    assert histogram.sum == total  # the same additions in the same order: the same float
