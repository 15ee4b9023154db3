"""deploy/haproxy-affinity.cfg as shipped (a real HAProxy, Debian's package) in front of two
gateway replicas: every request for one adapter reaches the same replica, whichever way the
client names the adapter (OpenAI's `model`, TGI's `parameters.adapter_id`, DJL's `adapters`, the
SageMaker header, the KServe path), the adapters spread over both replicas, and base-model
requests are balanced over both. Fake engine: what is tested is the routing; the effect on the
real engine (cold loads, requests/s, TTFT) is `python -m bench h`, bench/README.md.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.scenarios import lora_copies
from tests.integration.test_load_balancer import running_balancer
from tests.serverproc import (
    DEMO,
    ROOT,
    RunningServer,
    base_config,
    ensure_assets,
    merge,
    start_server,
    wait_ready,
)

CONFIG = ROOT / "deploy" / "haproxy-affinity.cfg"
ADAPTERS = 7  # odd and shuffled: a strict alternation of replicas would split every adapter
PER_STYLE = 2  # requests per adapter and naming style
Send = Callable[[httpx.Client, str], httpx.Response]


def openai(http: httpx.Client, name: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})


def tgi(http: httpx.Client, name: str) -> httpx.Response:
    body = {"inputs": "hi", "parameters": {"adapter_id": name, "max_new_tokens": 2}}
    return http.post("/generate", json=body)


def djl(http: httpx.Client, name: str) -> httpx.Response:
    body = {"inputs": "hi", "adapters": name, "parameters": {"max_new_tokens": 2}}
    return http.post("/invocations", json=body)


def sagemaker(http: httpx.Client, name: str) -> httpx.Response:
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 2}}
    headers = {"X-Amzn-SageMaker-Adapter-Identifier": name}
    return http.post("/invocations", json=body, headers=headers)


def kserve(http: httpx.Client, name: str) -> httpx.Response:
    body = {"text_input": "hi", "parameters": {"max_tokens": 2}}
    return http.post(f"/v2/models/{name}/generate", json=body)


STYLES: tuple[Send, ...] = (openai, tgi, djl, sagemaker, kserve)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningServer]]:
    ensure_assets()
    tmp = tmp_path_factory.mktemp("affinity")
    folder = tmp / "adapters"
    lora_copies(ADAPTERS, DEMO / "adapters" / "a1", folder, "h")
    overrides = {"LoraConfig": {"adapterDir": str(folder), "maxCpuLoras": ADAPTERS}}
    started = {
        name: start_server(tmp / name, merge(base_config("fake"), overrides))
        for name in ("r1", "r2")
    }
    try:
        for replica in started.values():
            wait_ready(replica, 120)
        yield started
    finally:
        for replica in started.values():
            replica.stop()


def counts(replica: RunningServer, family: str, label: str) -> dict[str, float]:
    text = httpx.get(f"{replica.metrics_url}/metrics", timeout=30).text
    return {
        sample.labels[label]: sample.value
        for metric in text_string_to_metric_families(text) if metric.name == family
        for sample in metric.samples if sample.name == f"{family}_total"
    }


def served_by(replicas: dict[str, RunningServer], family: str, label: str) -> dict[str, Any]:
    return {name: counts(replica, family, label) for name, replica in replicas.items()}


def test_each_adapter_stays_on_one_replica_and_the_base_model_spreads(
    tmp_path: Path, replicas: dict[str, RunningServer]
) -> None:
    names = [f"h{i:02d}" for i in range(ADAPTERS)]
    with running_balancer(tmp_path, replicas, CONFIG) as balancer, httpx.Client(
        base_url=f"http://127.0.0.1:{balancer.port}", timeout=60
    ) as http:
        order = random.Random(0)
        for _ in range(PER_STYLE):
            for send in STYLES:
                for name in order.sample(names, len(names)):
                    response = send(http, name)
                    assert response.status_code == 200, (send.__name__, response.text)
        before = served_by(replicas, "gateway_generation_requests", "protocol")
        for _ in range(8):
            assert openai(http, "tiny").status_code == 200
        after = served_by(replicas, "gateway_generation_requests", "protocol")
    per_adapter = served_by(replicas, "gateway_adapter_requests", "adapter")
    homes: dict[str, list[str]] = collections.defaultdict(list)
    for name in names:
        where = {replica: per_adapter[replica].get(name, 0.0) for replica in replicas}
        assert sorted(where.values()) == [0.0, PER_STYLE * len(STYLES)], (name, where)
        homes[max(where, key=lambda r: where[r])].append(name)
    assert set(homes) == set(replicas), homes  # the adapters spread over both
    base = {r: after[r].get("openai", 0.0) - before[r].get("openai", 0.0) for r in replicas}
    assert all(count > 0 for count in base.values()), base  # round robin without an adapter
