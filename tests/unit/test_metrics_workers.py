"""Prometheus multiprocess mode: two real worker processes (spawned with
`PROMETHEUS_MULTIPROC_DIR` set, as the supervisor starts them) each make known traffic; the
/metrics one of them serves shows the whole server: counters and histogram counts the exact
sums, live gauges the sums (until `worker_exited` drops an ended worker's), the lifecycle state
once. This process never imports prometheus_client in multiprocess mode (it picks its value
class at import), so the variable is set only while the workers start and `worker_exited` runs.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from server.observability.families import Observations, Value
from server.observability.metrics import worker_exited
from server.observability.shared import ENV, multiprocess_dir
from tests.unit.gateway_kit import make_gateway
from tests.unit.workers_kit import Plan, Ready, fixed_traffic, one_worker, worker

WAIT_S = 50  # a guard against a hung worker, not a measurement

PLANS = (
    Plan(generations=3, failures=1, inflight=2, queued_a1=1, first_token_s=(0.1, 0.1)),
    Plan(generations=2, failures=2, inflight=1, queued_a1=3, first_token_s=(0.4,)),
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[dict[str, str], Samples]:
    """Family types and samples of one exposition, which must declare every family and series
    once."""
    families: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in families, family.name
        families[family.name] = family.type
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in samples, key
            samples[key] = sample.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


class Worker:
    def __init__(self, process: BaseProcess, conn: Connection, ready: Ready) -> None:
        self.process, self.conn, self.ready = process, conn, ready

    def ask(self, command: str) -> Any:
        self.conn.send(command)
        assert self.conn.poll(WAIT_S), f"no answer to {command}"
        return self.conn.recv()


@pytest.fixture
def workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Worker]]:
    monkeypatch.setenv(ENV, str(tmp_path))  # the workers inherit it; undone after the test
    context = multiprocessing.get_context("spawn")
    started: list[tuple[BaseProcess, Connection]] = []
    try:
        for plan in PLANS:
            ours, theirs = context.Pipe()
            spawned = context.Process(target=worker, args=(theirs, plan), daemon=True)
            spawned.start()
            started.append((spawned, ours))
        ready = []
        for process, conn in started:
            assert conn.poll(WAIT_S), "a worker did not start"
            ready.append(Worker(process, conn, conn.recv()))
        yield ready
    finally:
        for process, conn in started:
            if process.is_alive():
                conn.send("exit")
                process.join(WAIT_S)
            if process.is_alive():
                process.kill()


def expected_counts(plans: tuple[Plan, ...]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    generations = sum(p.generations for p in plans)
    finished = sum(len(p.first_token_s) for p in plans)
    tgi = frozenset({("protocol", "tgi")})
    return {
        ("gateway_generation_requests_total", tgi): generations,
        ("gateway_generation_requests_total", frozenset({("protocol", "mindie")})): sum(
            p.inflight for p in plans
        ),
        ("gateway_generation_requests_total", frozenset({("protocol", "djl")})): finished,
        ("gateway_prompt_tokens_total", tgi): 3 * generations,
        ("gateway_generation_tokens_total", tgi): 5 * generations,
        ("gateway_time_to_first_token_seconds_count", tgi): generations,
        ("gateway_inter_token_latency_seconds_count", tgi): 4 * generations,
        ("gateway_inter_token_latency_seconds_bucket", tgi | {("le", "+Inf")}): 4 * generations,
        ("gateway_e2e_request_latency_seconds_count", tgi): generations,
        ("gateway_e2e_request_latency_seconds_count", frozenset({("protocol", "djl")})): finished,
        ("gateway_request_failures_total",
         frozenset({("protocol", "openai"), ("error_type", "unavailable")})): sum(
            p.failures for p in plans
        ),
        ("gateway_http_requests_total", frozenset(
            {("protocol", "kserve"), ("endpoint", "/v2/health/live"), ("status", "200")}
        )): generations,
    }


def expected_live(plans: tuple[Plan, ...]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        ("gateway_requests_inflight", frozenset({("protocol", "mindie")})): sum(
            p.inflight for p in plans
        ),
        ("gateway_requests_inflight", frozenset({("protocol", "tgi")})): 0,
        ("gateway_requests_queued", frozenset()): sum(p.queued_a1 + 1 for p in plans),
        ("gateway_adapter_requests_queued", frozenset({("adapter", "a1")})): sum(
            p.queued_a1 for p in plans
        ),
        ("gateway_adapter_requests_queued", frozenset({("adapter", "a2")})): 0,
    }


def window_ms(workers: list[Worker], kind: str) -> int:
    """The mean (ms) of every worker's window together: sums over lengths."""
    pairs = [
        (w.ready.ttft_sum, w.ready.ttft_count) if kind == "ttft"
        else (w.ready.tbt_sum, w.ready.tbt_count)
        for w in workers
    ]
    return round(sum(s for s, _ in pairs) / sum(n for _, n in pairs) * 1000)


def json_values(body: dict[str, Any]) -> dict[str, int]:
    return {item["metric"][0]["__name__"]: int(item["value"]) for item in body["result"]}


def test_metrics_served_by_one_worker_add_up_every_worker(workers: list[Worker]) -> None:
    text, body = workers[1].ask("render")
    families, samples = parse(text)
    for key, expected in (expected_counts(PLANS) | expected_live(PLANS)).items():
        assert samples.get(key, 0.0) == expected, key
    states = {k: v for k, v in samples.items() if k[0] == "gateway_lifecycle_state"}
    assert value(samples, "gateway_lifecycle_state", state="ready") == 1
    assert sum(states.values()) == 1 and len(states) == len({k[1] for k in states})
    assert sum(v for k, v in samples.items() if k[0] == "gateway_role") == 1
    assert not any(name.startswith("gateway_internal_") for name in families)
    assert families["gateway_requests_queued"] == "gauge"
    assert families["gateway_grpc_requests"] == "counter"  # declared, though no worker has a series
    assert value(samples, "gateway_adapters_loaded") == 3  # the registry's, not multiplied
    mindie = json_values(body)
    assert mindie["TTFT"] == window_ms(workers, "ttft")  # the windows of both workers pooled
    assert mindie["TBT"] == window_ms(workers, "tbt")
    assert mindie["waitingInferRequestNum"] == sum(p.queued_a1 + 1 for p in PLANS)


def test_an_ended_worker_keeps_its_counts_and_leaves_the_live_sums(
    workers: list[Worker],
) -> None:
    first, second = workers
    first.conn.send("crash")  # gone without a clean-up: its live numbers are still in its file
    first.process.join(WAIT_S)
    _, samples = parse(second.ask("render")[0])
    assert value(samples, "gateway_requests_inflight", protocol="mindie") == sum(
        p.inflight for p in PLANS
    )
    worker_exited(first.ready.pid)
    text, body = second.ask("render")
    _, samples = parse(text)
    for key, expected in expected_counts(PLANS).items():
        assert samples.get(key, 0.0) == expected, key
    for key, expected in expected_live(PLANS[1:]).items():
        assert samples.get(key, 0.0) == expected, key
    mindie = json_values(body)
    assert mindie["TTFT"] == window_ms([second], "ttft")
    assert mindie["waitingInferRequestNum"] == PLANS[1].queued_a1 + 1


def test_worker_exited_drops_only_live_files_and_only_in_multiprocess_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = [tmp_path / name for name in ("gauge_livesum_7.db", "counter_7.db")]
    for file in files:
        file.write_bytes(b"")
    monkeypatch.delenv(ENV, raising=False)
    worker_exited(7)  # one process: nothing to do
    assert all(file.exists() for file in files)
    monkeypatch.setenv(ENV, str(tmp_path))
    worker_exited(7)
    assert [file.exists() for file in files] == [False, True]


def test_a_variable_set_after_prometheus_client_was_imported_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="set after prometheus_client was imported"):
        multiprocess_dir()


def test_one_process_keeps_the_plain_families_and_the_default_registry() -> None:
    gateway = make_gateway()
    metrics = gateway.metrics
    assert metrics.shared_dir is None
    assert gateway.registries == (REGISTRY, metrics.registry)
    assert type(metrics.generations.labels("tgi")) is Value
    assert type(metrics.ttft.labels("tgi")) is Observations
    assert metrics.registry.get_sample_value("gateway_requests_queued") == 0


def gateway_only(parsed: tuple[dict[str, str], Samples]) -> tuple[dict[str, str], Samples]:
    families, samples = parsed
    return (
        {name: kind for name, kind in families.items() if name.startswith("gateway_")},
        {key: v for key, v in samples.items() if key[0].startswith("gateway_")},
    )


@pytest.mark.anyio
async def test_one_worker_in_multiprocess_mode_shows_what_one_process_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same fixed observations: the gateway families, types and samples (bucket edges, sums,
    counts) as one process exposes them."""
    monkeypatch.setenv(ENV, str(tmp_path))
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    spawned = context.Process(target=one_worker, args=(theirs,), daemon=True)
    spawned.start()
    try:
        assert ours.poll(WAIT_S), "the worker did not answer"
        shared = ours.recv()
    finally:
        spawned.join(WAIT_S)
    monkeypatch.delenv(ENV)
    alone = await fixed_traffic(make_gateway())
    assert gateway_only(parse(shared)) == gateway_only(parse(alone))
