"""A client that goes away aborts its engine request, on every protocol, streamed or not."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serverproc import RunningServer

LONG = 300
# One long generation per protocol and mode; each must run to LONG tokens unless aborted.
REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("openai", "/v1/completions", {"prompt": "a", "max_tokens": LONG, "ignore_eos": True}),
    (
        "openai-stream",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "a"}],
            "max_tokens": LONG,
            "ignore_eos": True,
            "stream": True,
        },
    ),
    (
        "tgi",
        "/generate",
        {
            "inputs": "a",
            "parameters": {
                "max_new_tokens": LONG,
                "grammar": {"type": "regex", "value": "[0-9]{300,}"},
            },
        },
    ),
    (
        "tgi-stream",
        "/generate_stream",
        {
            "inputs": "a",
            "parameters": {
                "max_new_tokens": LONG,
                "grammar": {"type": "regex", "value": "[0-9]{300,}"},
            },
        },
    ),
    (
        "triton",
        "/v2/models/tiny/generate",
        {"text_input": "a", "parameters": {"max_tokens": LONG, "ignore_eos": True}},
    ),
    (
        "triton-stream",
        "/v2/models/tiny/generate_stream",
        {"text_input": "a", "stream": True,
         "parameters": {"max_tokens": LONG, "ignore_eos": True}},
    ),
    ("mindie", "/generate", {"prompt": "a", "max_tokens": LONG, "ignore_eos": True}),
    (
        "mindie-stream",
        "/generate",
        {"prompt": "a", "max_tokens": LONG, "ignore_eos": True, "stream": True},
    ),
    (
        "djl",
        "/invocations",
        {"inputs": "a", "parameters": {"max_new_tokens": LONG, "ignore_eos_token": True}},
    ),
    (
        "djl-stream",
        "/invocations",
        {
            "inputs": "a",
            "parameters": {"max_new_tokens": LONG, "ignore_eos_token": True},
            "stream": True,
        },
    ),
]


def scrape(server: RunningServer) -> dict[str, float]:
    text = httpx.get(f"{server.metrics_url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("gateway_requests_inflight", "vllm:generation_tokens_total"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def wait_idle(server: RunningServer, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    values = scrape(server)
    while values.get("gateway_requests_inflight", 0) and time.monotonic() < deadline:
        time.sleep(0.1)
        values = scrape(server)
    return values


def read_a_little_then_hang_up(server: RunningServer, path: str, body: dict[str, Any]) -> None:
    with (
        httpx.Client(base_url=server.url, timeout=30) as client,
        client.stream("POST", path, json=body) as response,
    ):
        assert response.status_code == 200
        chunks = response.iter_bytes()
        next(chunks)
        next(chunks)


@pytest.mark.parametrize(("name", "path", "body"), REQUESTS, ids=[r[0] for r in REQUESTS])
def test_client_disconnect_aborts_the_engine_request(
    live_server: RunningServer, name: str, path: str, body: dict[str, Any]
) -> None:
    before = wait_idle(live_server)
    if body.get("stream") or name.endswith("stream"):
        read_a_little_then_hang_up(live_server, path, body)
    else:
        # The client gives up after 0.1 s and closes the connection (an idle machine makes the
        # 300 short digit tokens of the TGI grammar case in about 0.25 s).
        client = httpx.Client(base_url=live_server.url, timeout=0.1)
        with client, pytest.raises(httpx.TimeoutException):
            client.post(path, json=body)
    after = wait_idle(live_server)
    assert after["gateway_requests_inflight"] == 0
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < LONG, f"{name}: {generated} tokens generated after the client left"
    # and the engine serves on
    ok = httpx.post(f"{live_server.url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200
