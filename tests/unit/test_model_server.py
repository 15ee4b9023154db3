"""The model-server contract's pieces (server/observability/model_server.py): the adapter split
and the corrected queue depth. The whole contract on the real engine, with the gateway queueing
and with two workers: tests/integration/test_model_server_metrics.py."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.core.adapters import AdapterSnapshot, Residency
from server.core.types import AdapterLoad, EngineStats
from server.observability.model_server import (
    ServerLoad,
    _Corrected,
    lora_families,
    with_gateway_queue,
)


def snapshot(name: str, residency: Residency) -> AdapterSnapshot:
    return AdapterSnapshot(
        name=name, int_id=1, residency=residency, pinned=False, rank=8, inflight=0, requests=0,
        generated_tokens=0, loads=1, evictions=0, load_failures=0, last_used=0.0,
        load_buckets=(0, 1), load_seconds=0.05,
    )


def load(**engine: AdapterLoad) -> ServerLoad:
    return ServerLoad(
        queued=3.0,
        queued_by_adapter={"a1": 2.0, "": 1.0, "not-an-adapter": 4.0},
        scheduler=EngineStats(running=2, waiting=1, total_blocks=100, free_blocks=75),
        engine=engine,
        adapters=[
            snapshot("a1", Residency.CPU_CACHE), snapshot("a2", Residency.ENGINE_SLOT),
            snapshot("a3", Residency.ENGINE_SLOT), snapshot("a4", Residency.REGISTERED),
        ],
        at=1.8e9,
    )


def corrected(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """`registry` as /metrics serves it with `load()`'s readings: (name, labels) -> value."""
    text = generate_latest(_Corrected(registry, load())).decode()  # type: ignore[arg-type]
    return {
        (s.name, tuple(s.labels.items())): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def test_running_and_waiting_are_split_by_where_the_requests_are() -> None:
    state = load(a2=AdapterLoad(running=1, waiting=0), a3=AdapterLoad(running=1, waiting=2))
    assert state.running_adapters() == ["a2", "a3"]
    # queued at the gateway (a1; the base model and unknown names are no adapters) or in the
    # engine's queue (a3, which also runs)
    assert state.waiting_adapters() == ["a1", "a3"]


def test_lora_requests_info_is_one_series_with_the_split() -> None:
    families = lora_families(
        load(a2=AdapterLoad(running=2, waiting=0)), max_loras=2, max_cpu_loras=4
    )
    info = families[0]
    assert [(s.labels, s.value) for s in info.samples] == [(
        {"max_lora": "2", "waiting_lora_adapters": "a1", "running_lora_adapters": "a2"}, 1.8e9,
    )]
    by_name = {f.name: f for f in families}
    levels = {s.labels["adapter_name"]: s.labels["level"]
              for s in by_name["vllm:lora_adapter_loaded"].samples}
    assert levels == {"a1": "cpu", "a2": "gpu", "a3": "cpu"}  # a4 is not loaded
    assert by_name["vllm:num_gpu_loaded_lora_adapters"].samples[0].value == 1
    assert by_name["vllm:num_cpu_loaded_lora_adapters"].samples[0].value == 2


def test_vllms_queue_depth_gets_the_gateways_queue_and_its_lora_info_is_dropped() -> None:
    registry = CollectorRegistry()
    waiting = Gauge("vllm:num_requests_waiting", "w", ["engine"], registry=registry)
    waiting.labels("1").set(5)
    waiting.labels("0").set(2)
    info = Gauge("vllm:lora_requests_info", "i", ["running_lora_adapters"], registry=registry)
    info.labels("a1,a2").set(1)
    assert corrected(registry) == {
        ("vllm:num_requests_waiting", (("engine", "0"),)): 5.0,  # 2 + the gateway's 3, once
        ("vllm:num_requests_waiting", (("engine", "1"),)): 5.0,
    }


def test_the_queue_is_added_to_a_single_series_too() -> None:
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "w", registry=registry).set(1)
    (family,) = registry.collect()
    assert [s.value for s in with_gateway_queue(family, 4.0).samples] == [5.0]


def test_one_engines_numbers_are_the_shared_ones_plus_the_gateways_queue() -> None:
    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    for name, stale in (("vllm:num_requests_waiting", 7), ("vllm:num_requests_running", 0),
                        ("vllm:kv_cache_usage_perc", 0.9)):
        Gauge(name, "g", labels, registry=registry).labels("0", "tiny").set(stale)
    samples = {name: value for (name, _), value in corrected(registry).items()}
    assert samples == {
        "vllm:num_requests_waiting": 4.0,  # the engine's 1 and the gateway's 3
        "vllm:num_requests_running": 2.0,
        "vllm:kv_cache_usage_perc": 0.25,
    }


def test_the_gateways_queue_families_show_the_scrapes_one_reading() -> None:
    """With workers the others change their files while a scrape merges them: the queue the
    scrape read for `vllm:num_requests_waiting` is the one its own queue families show."""
    registry = CollectorRegistry()
    Gauge("gateway_requests_queued", "q", registry=registry).set(7)
    per_adapter = Gauge("gateway_adapter_requests_queued", "q", ["adapter"], registry=registry)
    per_adapter.labels("a1").set(5)
    per_adapter.labels("a2").set(1)
    assert corrected(registry) == {
        ("gateway_requests_queued", ()): 3.0,
        ("gateway_adapter_requests_queued", (("adapter", "a1"),)): 2.0,
        ("gateway_adapter_requests_queued", (("adapter", "a2"),)): 0.0,
    }
