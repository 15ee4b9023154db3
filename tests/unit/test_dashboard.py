"""deploy/grafana-dashboard.json: valid Grafana JSON, and every gateway metric its queries read
is one the gateway declares (the vLLM families are checked on the real engine in
tests/integration/test_prometheus.py)."""

from __future__ import annotations

import pytest

from tests.dashboard import (
    dashboard_metrics,
    declared_names,
    load,
    metric_names,
    panel_exprs,
    sampled_names,
)
from tests.unit.gateway_kit import client, make_gateway

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (protocol) (rate(gateway_http_requests_total{job=~"$job"}[$__rate_interval]))',
         {"gateway_http_requests_total"}),
        ('histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket'
         '{le!="+Inf", a="rate(x)"}[5m])))', {"vllm:time_to_first_token_seconds_bucket"}),
        ("2 * sum(a_total) without (b) + on (c) group_left (d) b_gauge offset 5m > bool 1e3",
         {"a_total", "b_gauge"}),
        ("max_over_time(up[1h:5m]) unless absent(x)", {"up", "x"}),
        ('sum(rate(a_total{l="1"}[1m])) by (le) / ignoring(z) c', {"a_total", "c"}),
    ],
)
def test_metric_names_are_read_out_of_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_declared_names_follow_the_exposition_types() -> None:
    text = (
        "# TYPE a counter\na_total 1\n# TYPE h histogram\n"
        "# TYPE vllm:g gauge\nvllm:g 2\n# TYPE s summary\n"
    )
    assert declared_names(text) == {
        "a_total", "h_bucket", "h_sum", "h_count", "vllm:g", "s", "s_sum", "s_count",
    }
    assert sampled_names(text) == {"a_total", "vllm:g"}


def test_the_dashboard_is_grafana_json_with_a_datasource_variable() -> None:
    dashboard = load()
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["type"] in {"timeseries", "stat", "state-timeline", "table"}, panel
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["datasource"]["uid"] == "${datasource}"
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert metric_names(target["expr"]), (panel["title"], target["expr"])


def test_the_dashboard_shows_what_operators_watch() -> None:
    names = set(dashboard_metrics(load()))
    assert {
        "gateway_http_requests_total",  # request rate, errors by protocol and status
        "gateway_request_failures_total",
        "gateway_time_to_first_token_seconds_bucket",
        "gateway_inter_token_latency_seconds_bucket",
        "gateway_requests_queued",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "gateway_adapter_requests_total",
        "gateway_adapter_residency",
        "gateway_adapter_cold_loads_total",
        "gateway_adapter_load_seconds_bucket",
        "gateway_lifecycle_state",
        "gateway_grpc_requests_total",
    } <= names
    assert all(name.startswith(("gateway_", "vllm:")) for name in names), names


async def test_every_gateway_metric_of_the_dashboard_is_declared_by_the_gateway() -> None:
    gateway = make_gateway()
    async with client(gateway, "data") as http:
        await http.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2})
    async with client(gateway, "metrics") as http:
        exposed = declared_names((await http.get("/metrics")).text)
    missing = {
        name: sorted(panels)
        for name, panels in dashboard_metrics(load()).items()
        if name.startswith("gateway_") and name not in exposed
    }
    assert not missing
    assert len(panel_exprs(load())) >= 16
