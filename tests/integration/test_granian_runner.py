"""`ServerConfig.httpRunner: "granian"` on real server processes: the official OpenAI client
over mutual TLS (encrypted key, a CRL) on the real engine, base model and a LoRA adapter, every
refused client refused, bad input answered exactly as uvicorn's path answers it, and the HTTP
limits of tests/integration/test_limits.py run again here, unchanged, against a fake-engine
granian server (the tests imported below use this module's `limited`). What granian does
differently is listed in docs/operations.md (HTTP runner) and pinned at the end.
"""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.integration.test_limits import (  # noqa: F401 - collected here, on granian
    RECEIVE_TIMEOUT,
    assert_serving_and_idle,
    read_to_eof,
    request_head,
    test_body_of_exactly_the_limit_is_served,
    test_body_over_the_limit_is_413_on_every_post_route,
    test_body_trickle_is_closed,
    test_client_that_stops_reading_a_stream_is_dropped_and_its_request_aborted,
    test_endless_8_mb_header_is_cut_off_with_431,
    test_garbage_request_line_is_400_and_serving_continues,
    test_header_block_over_the_limit_is_431,
    test_idle_keep_alive_connections_do_not_block_new_requests,
    test_over_long_url_is_414,
    test_stream_longer_than_the_receive_deadline_is_not_cut,
    test_too_many_headers_is_431,
    trickle,
)
from tests.integration.test_mtls import REFUSED_CLIENTS, all_tls_overrides, client_context
from tests.serverproc import RunningServer, running_server


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """test_limits.py's `limited` server, on granian."""
    overrides = {
        "ServerConfig": {
            "httpRunner": "granian",
            "maxHeaderBytes": 8192,
            "maxHeaderCount": 32,
            "requestReceiveTimeout": RECEIVE_TIMEOUT,
            "sendTimeout": 1.5,
            "maxLinkNum": 2,
        },
        "ModelConfig": {"engineOptions": {"token_delay_s": 0.05}},
    }
    folder = tmp_path_factory.mktemp("granian-limits")
    with running_server(folder, engine="fake", overrides=overrides, ready_timeout=60) as server:
        yield server
        assert_serving_and_idle(server)


@pytest.fixture(scope="module")
def tls_granian(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """test_mtls.py's three mutual-TLS planes (data on an encrypted key, a CRL), on granian
    and the real engine."""
    overrides = all_tls_overrides()
    overrides["ServerConfig"]["httpRunner"] = "granian"
    folder = tmp_path_factory.mktemp("granian-mtls")
    with running_server(
        folder, engine="vllm", overrides=overrides, ready_timeout=600,
        client_tls=client_context(),
    ) as server:
        yield server
        assert server.stop() == 0  # the gateway's own SIGTERM path: drained, exit 0
        log = server.log()
        assert "gateway [-] stopped" in log
        assert "panicked" not in log  # nothing in granian's Rust threads failed


def https(server: RunningServer, port: int, path: str) -> str:
    return f"https://127.0.0.1:{port}{path}"


def planes(server: RunningServer) -> dict[str, str]:
    return {
        "data": https(server, server.data_port, "/v1/models"),
        "management": https(server, server.management_port, "/v1/status"),
        "metrics": https(server, server.metrics_port, "/metrics"),
    }


# ---- mutual TLS ---------------------------------------------------------------------------------
def test_openai_client_over_mutual_tls(tls_granian: RunningServer) -> None:
    with httpx.Client(verify=client_context(), timeout=30) as http:
        client = openai.OpenAI(
            base_url=f"{tls_granian.url.replace('http:', 'https:')}/v1", api_key="none",
            http_client=http,
        )
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=4
        )
        stream = client.completions.create(
            model="a1", prompt="stream me", max_tokens=5, stream=True,
            stream_options={"include_usage": True},
        )
        events = list(stream)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 5
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"


@pytest.mark.parametrize("plane", ["data", "management", "metrics"])
def test_trusted_client_is_served_and_untrusted_ones_refused(
    tls_granian: RunningServer, plane: str
) -> None:
    url = planes(tls_granian)[plane]
    with httpx.Client(verify=client_context(), timeout=30) as http:
        assert http.get(url).status_code == 200
    for case, context in REFUSED_CLIENTS.items():
        with (
            httpx.Client(verify=context(), timeout=30) as http,
            pytest.raises(httpx.TransportError),
        ):
            http.get(url)
            pytest.fail(f"{case} was served")


def test_tls_1_2_offers_only_aead_suites(tls_granian: RunningServer) -> None:
    context = client_context()
    context.maximum_version = __import__("ssl").TLSVersion.TLSv1_2
    with httpx.Client(verify=context, timeout=30) as http, http.stream(
        "GET", planes(tls_granian)["data"]
    ) as response:
        ssl_object = response.extensions["network_stream"].get_extra_info("ssl_object")
        assert ssl_object.version() == "TLSv1.2"
        cipher = ssl_object.cipher()[0]
        assert "GCM" in cipher or "CHACHA20" in cipher


# ---- bad input: the same answers as uvicorn's path ---------------------------------------------
BAD_INPUT: dict[str, tuple[str, dict[str, Any]]] = {
    "malformed-json": ("/v1/chat/completions", {"content": b"{not json"}),
    "oversized-body": ("/v1/completions", {"content": b'{"prompt": "' + b"x" * 2**20 + b'"}'}),
    "wrong-type": ("/v1/completions", {"json": {"model": "tiny", "prompt": 5, "max_tokens": "a"}}),
    "unknown-model": ("/v1/completions", {"json": {"model": "nope", "prompt": "hi"}}),
    "tgi-bad-params": ("/generate", {"json": {"inputs": "x", "parameters": {"top_p": 7}}}),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_gets_the_answer_uvicorn_gives(
    limited: RunningServer, fake_server: RunningServer, case: str
) -> None:
    path, request = BAD_INPUT[case]
    headers = {"content-type": "application/json"}
    answers = []
    for server in (fake_server, limited):
        response = httpx.post(f"{server.url}{path}", headers=headers, timeout=30, **request)
        answers.append((response.status_code, response.headers["content-type"],
                        json.loads(response.text)))
    assert answers[0][0] >= 400
    assert answers[1] == answers[0]


# ---- what granian does differently (docs/operations.md, HTTP runner) ---------------------------
def test_a_silent_or_trickling_head_is_closed_at_the_deadline_without_a_408(
    limited: RunningServer,
) -> None:
    """uvicorn's path answers 408 first; hyper closes the connection at the same deadline."""
    with socket.create_connection(("127.0.0.1", limited.data_port), timeout=20) as sock:
        assert read_to_eof(sock) == b""
    assert trickle(limited.data_port, b"GET /v1/models HTTP/1.1\r\n", b"x-a: b\r\n") == b""
    with socket.create_connection(("127.0.0.1", limited.data_port), timeout=20) as sock:
        sock.sendall(request_head())
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_a_stream_in_flight_at_sigterm_finishes_and_the_server_exits_0(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The gateway's own drain path, with granian's listeners stopped after it."""
    overrides = {"ServerConfig": {"httpRunner": "granian"},
                 "ModelConfig": {"engineOptions": {"token_delay_s": 0.05}}}
    folder = tmp_path_factory.mktemp("granian-drain")
    with running_server(folder, engine="fake", overrides=overrides, ready_timeout=60) as server:
        body = {"prompt": "drain", "max_tokens": 40, "stream": True}  # 2 s of events
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{server.url}/v1/completions", json=body) as response,
        ):
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            server.process.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert server.process.wait(60) == 0
    assert len([line for line in rest if line.startswith("data: {")]) == 39
    assert "data: [DONE]" in rest
