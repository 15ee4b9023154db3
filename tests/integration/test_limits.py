"""HTTP limits on a real server process (server/limits.py, RELIABILITY_PERF.md B.4, B.7 #3, #6-#12).

Request bodies past `maxRequestLength` (with Content-Length and chunked), request heads past
`maxHeaderBytes`/`maxHeaderCount` (httptools alone accepts 8 MB), requests that trickle in
(slowloris), connections beyond 3 × `maxLinkNum`, clients that stop reading a stream, and a
flood of 10× the admission capacity. Transport limits run on fake-engine servers (fast start,
scriptable token pace); request bounds run on the real engine (`live_server`). Every test ends
with the server still serving and nothing in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.traffic import management_client
from tests.operations import OPERATIONS
from tests.serverproc import RunningServer, running_server

LIMIT = 1024 * 1024  # maxRequestLength 1 (MB) in tests/serverproc.py base_config
RECEIVE_TIMEOUT = 1.5
PATH_VALUES = {"model": "tiny", "version": "1", "name": "a1", "role": "flex"}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    overrides = {
        "ServerConfig": {
            "maxHeaderBytes": 8192,
            "maxHeaderCount": 32,
            "requestReceiveTimeout": RECEIVE_TIMEOUT,
            "sendTimeout": 1.5,
            "maxLinkNum": 2,  # 6 connections per listener
        },
        "ModelConfig": {"engineOptions": {"token_delay_s": 0.05}},
    }
    folder = tmp_path_factory.mktemp("limits")
    with running_server(folder, engine="fake", overrides=overrides, ready_timeout=60) as server:
        yield server
        assert_serving_and_idle(server)


def inflight(server: RunningServer) -> float:
    text = httpx.get(f"{server.metrics_url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gateway_requests_inflight"
    )


def wait_idle(server: RunningServer, deadline_s: float = 30.0) -> float:
    end = time.monotonic() + deadline_s
    while (count := inflight(server)) and time.monotonic() < end:
        time.sleep(0.1)
    return count


def assert_serving_and_idle(server: RunningServer) -> None:
    body = {"prompt": "still serving", "max_tokens": 2}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "still serving "
    assert wait_idle(server) == 0


def concrete(path: str) -> str:
    path = path.replace("/v2/role/{role}", "/v2/role/prefill")  # v2 knows prefill and decode
    for name, value in PATH_VALUES.items():
        path = path.replace("{" + name + "}", value)
    return path


POSTS = sorted({(op.listener, concrete(op.path)) for op in OPERATIONS if op.method == "POST"})


def client_for(server: RunningServer, listener: str) -> httpx.Client:
    if listener == "management":
        return management_client(server, timeout=60)
    return httpx.Client(base_url=server.url, timeout=60)


# ---- bodies (B.7 #6) ---------------------------------------------------------------------------
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize(("listener", "path"), POSTS)
def test_body_over_the_limit_is_413_on_every_post_route(
    limited: RunningServer, listener: str, path: str, chunked: bool
) -> None:
    payload = b'{"inputs": "' + b"x" * LIMIT + b'"}'

    def pieces() -> Iterator[bytes]:
        for start in range(0, len(payload), 256 * 1024):
            yield payload[start : start + 256 * 1024]

    if chunked and path == "/ping":
        pytest.skip("POST /ping never reads its body: a chunked one is discarded, not refused")
    content = pieces() if chunked else payload
    headers = {"content-type": "application/json"}
    with client_for(limited, listener) as http:
        response = http.post(path, content=content, headers=headers)
    assert response.status_code == 413, response.text
    assert "limit" in response.text
    response.json()  # in the route's own JSON envelope


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "limit", "max_tokens": 2}),
        ("/generate", {"inputs": "limit", "parameters": {"max_new_tokens": 2}}),
        ("/v2/models/tiny/generate", {"text_input": "limit", "max_tokens": 2}),
    ],
)
def test_body_of_exactly_the_limit_is_served(
    limited: RunningServer, path: str, body: dict[str, Any]
) -> None:
    raw = json.dumps(body).encode()
    raw += b" " * (LIMIT - len(raw))  # JSON allows trailing whitespace
    assert len(raw) == LIMIT
    response = httpx.post(
        f"{limited.url}{path}", content=raw, headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()


# ---- request heads (B.7 #7) --------------------------------------------------------------------
def raw_exchange(port: int, data: bytes, *, read_timeout: float = 15.0) -> bytes:
    """Send `data` (ignoring a reset once the server answered early) and read to EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(data)
        return read_to_eof(sock)


def read_to_eof(sock: socket.socket) -> bytes:
    received = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def request_head(path: str = "/v1/models", headers: dict[str, str] | None = None) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_header_block_over_the_limit_is_431(limited: RunningServer) -> None:
    answer = raw_exchange(limited.data_port, request_head(headers={"x-big": "a" * 9000}))
    assert answer.startswith(b"HTTP/1.1 431 ")
    within = httpx.get(f"{limited.url}/v1/models", headers={"x-big": "a" * 6000}, timeout=30)
    assert within.status_code == 200


def test_too_many_headers_is_431(limited: RunningServer) -> None:
    many = {f"x-h{i}": "1" for i in range(40)}
    assert raw_exchange(limited.data_port, request_head(headers=many)).startswith(
        b"HTTP/1.1 431 "
    )
    some = {f"x-h{i}": "1" for i in range(20)}
    assert httpx.get(f"{limited.url}/v1/models", headers=some, timeout=30).status_code == 200


def test_endless_8_mb_header_is_cut_off_with_431(limited: RunningServer) -> None:
    """CVE-2025-48956 class: one huge header must not be buffered whole."""
    head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nx-huge: "
    answer = raw_exchange(limited.data_port, head + b"a" * 8_000_000)
    assert answer.startswith(b"HTTP/1.1 431 ")


def test_over_long_url_is_414(limited: RunningServer) -> None:
    answer = raw_exchange(limited.data_port, request_head("/v1/models?" + "q" * 9000))
    assert answer.startswith(b"HTTP/1.1 414 ")


def test_garbage_request_line_is_400_and_serving_continues(limited: RunningServer) -> None:
    for junk in (b"\x00\x01\x02 / HTTP/1.1\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"\r\n" * 3 + b"X"):
        answer = raw_exchange(limited.data_port, junk, read_timeout=10)
        assert answer == b"" or answer[9:10] == b"4", answer[:60]
    assert_serving_and_idle(limited)


# ---- paths no route serves ---------------------------------------------------------------------
def test_unknown_paths_and_wrong_methods_answer_as_vllm_does(limited: RunningServer) -> None:
    """The data listener answers `{"detail": ...}` JSON as vLLM does, which the OpenAI SDK reads
    as the error body; the management and metrics listeners keep MindIE's envelope."""
    with httpx.Client(base_url=limited.url, timeout=30) as http:
        missing = http.get("/nope")
        wrong = http.get("/v1/completions")
        slash = http.post("/v1/completions/", json={})
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    assert missing.headers["content-type"] == "application/json"
    assert (wrong.status_code, wrong.json()) == (405, {"detail": "Method Not Allowed"})
    assert wrong.headers["allow"] == "POST"
    assert slash.status_code == 307 and slash.headers["location"].endswith("/v1/completions")
    with openai.OpenAI(base_url=f"{limited.url}/v1", api_key="EMPTY", max_retries=0) as sdk:
        with pytest.raises(openai.NotFoundError) as not_found:
            sdk.get("/nope", cast_to=object)
        with pytest.raises(openai.APIStatusError) as not_allowed:
            sdk.post("/models", cast_to=object)
    assert not_found.value.status_code == 404
    assert not_found.value.body == {"detail": "Not Found"}
    assert not_allowed.value.status_code == 405
    assert not_allowed.value.body == {"detail": "Method Not Allowed"}
    with management_client(limited, timeout=30) as mgmt:
        control = mgmt.get("/nope")
    metrics = httpx.get(f"{limited.metrics_url}/nope", timeout=30)
    for answer in (control, metrics):
        assert answer.status_code == 404
        assert answer.json() == {"error": "No route /nope on this listener.",
                                 "error_type": "NotFoundError"}


# ---- slow requests (B.7 #8) --------------------------------------------------------------------
def trickle(port: int, first: bytes, drip: bytes, *, every: float = 0.3) -> bytes:
    """Send `first`, then `drip` every `every` s until the server closes (at most 20 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(first)
        end = time.monotonic() + 20
        sock.settimeout(every)
        while time.monotonic() < end:
            try:
                answer = sock.recv(65536)
            except TimeoutError:
                try:
                    sock.sendall(drip)
                except OSError:
                    return read_to_eof(sock)
                continue
            except OSError:
                return b""
            return answer + read_to_eof(sock)
    pytest.fail("the server kept a trickling request open for 20 s")


def test_header_trickle_is_closed_with_408(limited: RunningServer) -> None:
    answer = trickle(limited.data_port, b"GET /v1/models HTTP/1.1\r\n", b"x-a: b\r\n")
    assert answer.startswith(b"HTTP/1.1 408 ")


def test_body_trickle_is_closed(limited: RunningServer) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n{"
    )
    answer = trickle(limited.data_port, head, b" ")
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
    assert_serving_and_idle(limited)


def test_connection_that_sends_nothing_is_closed(limited: RunningServer) -> None:
    with socket.create_connection(("127.0.0.1", limited.data_port), timeout=20) as sock:
        assert read_to_eof(sock).startswith(b"HTTP/1.1 408 ")


def test_stream_longer_than_the_receive_deadline_is_not_cut(limited: RunningServer) -> None:
    body = {"prompt": "a long answer", "max_tokens": 60, "stream": True}  # 60 × 50 ms = 3 s
    chunks = []
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{limited.url}/v1/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
    assert len(chunks) == 60
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---- connections (B.7 #10) ---------------------------------------------------------------------
def keep_alive_request(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(request_head("/v1/models"))
    assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    return sock


def test_idle_keep_alive_connections_do_not_block_new_requests(limited: RunningServer) -> None:
    idle = [keep_alive_request(limited.data_port) for _ in range(6)]  # the cap: 3 × maxLinkNum
    try:
        for _ in range(3):
            fresh = httpx.get(f"{limited.url}/v1/models", timeout=30)
            assert fresh.status_code == 200
    finally:
        for sock in idle:
            sock.close()


def test_connections_beyond_the_cap_get_503_when_none_is_idle(limited: RunningServer) -> None:
    async def scenario() -> None:
        body = {"prompt": "hold the line", "max_tokens": 100, "stream": True}  # 5 s each
        started = asyncio.Event()
        holders = []
        async with httpx.AsyncClient(
            base_url=limited.url, timeout=30, limits=httpx.Limits(max_connections=6)
        ) as http:

            async def hold() -> None:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    async for _ in response.aiter_lines():
                        started.set()
                        if refused.is_set():
                            return

            refused = asyncio.Event()
            holders = [asyncio.create_task(hold()) for _ in range(6)]
            await started.wait()
            await asyncio.sleep(0.5)
            answer = await asyncio.to_thread(raw_exchange, limited.data_port, request_head())
            refused.set()
            assert answer.startswith(b"HTTP/1.1 503 "), answer[:100]
            await asyncio.gather(*holders)

    asyncio.run(scenario())
    assert_serving_and_idle(limited)


# ---- a client that stops reading (B.7 #12) -----------------------------------------------------
def test_client_that_stops_reading_a_stream_is_dropped_and_its_request_aborted(
    limited: RunningServer,
) -> None:
    word = "w" * 200_000  # every token repeats the prompt's one word: 200 kB per SSE event
    body = json.dumps({"prompt": word, "max_tokens": 500, "stream": True}).encode()  # 25 s
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", limited.data_port))
    try:
        sock.sendall(head + body)
        end = time.monotonic() + 10
        while inflight(limited) != 1 and time.monotonic() < end:
            time.sleep(0.05)  # until the stream is running (and nobody reads it)
        # dropped after sendTimeout, long before the 25 s stream could end; engine request aborted
        assert wait_idle(limited, 12) == 0
        sock.settimeout(10)  # the server closed its end: EOF or reset, not a timeout
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(1 << 20):
                pass
    finally:
        sock.close()
    assert_serving_and_idle(limited)


# ---- admission flood (B.7 #9) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_capacity(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """4 running + 4 queued; each admitted request takes about a second."""
    overrides = {
        "LimitsConfig": {"maxConcurrentRequests": 4, "maxQueue": 4},
        "ModelConfig": {"engineOptions": {"token_delay_s": 0.05}},
    }
    folder = tmp_path_factory.mktemp("flood")
    with running_server(folder, engine="fake", overrides=overrides, ready_timeout=60) as server:
        yield server
        assert_serving_and_idle(server)


def held(server: RunningServer) -> int:
    """Admitted plus queued requests, from the management listener's status."""
    with management_client(server, timeout=30) as http:
        gateway = http.get("/v1/status").json()["gateway"]
    return int(gateway["admitted"]) + int(gateway["queued"])


def wait_held(server: RunningServer, count: int) -> None:
    end = time.monotonic() + 30
    while held(server) < count and time.monotonic() < end:
        time.sleep(0.1)  # until the holders fill the slots and the queue


def rss_kib(server: RunningServer) -> int:
    for line in open(f"/proc/{server.process.pid}/status").read().splitlines():  # noqa: SIM115
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def flood(
    server: RunningServer, count: int, concurrency: int, path: str, body: dict[str, Any]
) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:

        async def one() -> httpx.Response:
            async with gate:
                return await http.post(path, json=body)

        return list(await asyncio.gather(*(one() for _ in range(count))))


def test_ten_times_capacity_gets_429_while_admitted_requests_finish(
    small_capacity: RunningServer,
) -> None:
    body = {"prompt": "admitted requests finish normally", "max_tokens": 20}
    answers = asyncio.run(flood(small_capacity, 80, 80, "/v1/completions", body))
    served = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(served) + len(refused) == 80
    assert len(served) >= 8
    assert len(refused) >= 60
    for answer in served:
        choice = answer.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert answer.json()["usage"]["completion_tokens"] == 20
    for answer in refused:
        assert int(answer.headers["retry-after"]) >= 1
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("RateLimitError", 429)


def test_flood_on_tgi_gets_its_overloaded_shape(small_capacity: RunningServer) -> None:
    body = {"inputs": "tgi flood", "parameters": {"max_new_tokens": 20}}
    answers = asyncio.run(flood(small_capacity, 80, 80, "/generate", body))
    refused = [a for a in answers if a.status_code == 429]
    assert len(refused) >= 60
    assert refused[0].json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    assert all(a.json()["generated_text"] for a in answers if a.status_code == 200)


def test_memory_stays_flat_under_a_flood_of_refusals(small_capacity: RunningServer) -> None:
    """8 long requests hold every slot and queue place; 2,000 more are refused with 429."""

    async def scenario() -> tuple[list[httpx.Response], int, int]:
        long_body = {"prompt": "hold every slot", "max_tokens": 500}  # 25 s: outlives the flood
        async with httpx.AsyncClient(base_url=small_capacity.url, timeout=60) as http:
            holders = [
                asyncio.create_task(http.post("/v1/completions", json=long_body))
                for _ in range(8)
            ]
            await asyncio.to_thread(wait_held, small_capacity, 8)
            await flood(small_capacity, 200, 50, "/v1/completions", long_body)  # warm-up
            before = rss_kib(small_capacity)
            answers = await flood(small_capacity, 2000, 50, "/v1/completions", long_body)
            after = rss_kib(small_capacity)
            for holder in holders:
                holder.cancel()  # the clients go away: their requests are aborted
            await asyncio.gather(*holders, return_exceptions=True)
        return answers, before, after

    answers, before, after = asyncio.run(scenario())
    assert {a.status_code for a in answers} == {429}
    assert after - before < 16 * 1024, f"RSS grew {after - before} KiB over 2,000 refusals"
    assert wait_idle(small_capacity) == 0


# ---- request bounds on every protocol, real engine (B.7 #3) ------------------------------------
# OpenAI `best_of` is not read at all (vLLM's V1 dropped it; an unknown field is ignored).
BOUNDS: list[tuple[str, dict[str, Any], int]] = [
    ("/v1/completions", {"prompt": "x", "n": 10_000}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": 10_000}, 400),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 1000}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10_000_000}, 400),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 10_000}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 10_000}, 400),
    ("/generate", {"inputs": "x", "parameters": {"best_of": 10_000, "do_sample": True}}, 422),
    ("/generate", {"inputs": "x", "parameters": {"top_n_tokens": 10_000}}, 422),
    ("/generate", {"inputs": "x", "parameters": {"stop": ["s"] * 1000}}, 422),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 10_000_000}}, 422),
    ("/generate", {"inputs": "x", "parameters": {"temperature": -1.0}}, 422),
    ("/generate", {"prompt": "x", "n": 10_000}, 422),  # MindIE's vLLM flavour
    ("/generate", {"prompt": "x", "stop": ["s"] * 1000}, 422),
    ("/infer", {"inputs": "x", "parameters": {"max_new_tokens": 10_000_000}}, 422),
    ("/v2/models/tiny/generate", {"text_input": "x", "max_tokens": 10_000_000}, 400),
    ("/v2/models/tiny/generate", {"text_input": "x", "n": 10_000}, 400),
    ("/invocations", {"inputs": "x", "parameters": {"n": 10_000}}, 424),
    ("/invocations", {"inputs": "x", "parameters": {"max_new_tokens": 10_000_000}}, 424),
    ("/invocations", {"inputs": ["x"] * 10_000}, 424),
]


@pytest.mark.parametrize(("path", "body", "status"), BOUNDS)
def test_bounds_are_refused_before_the_engine(
    live_server: RunningServer, path: str, body: dict[str, Any], status: int
) -> None:
    response = httpx.post(f"{live_server.url}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()


def test_live_engine_serves_and_nothing_is_in_flight_after_the_bounds(
    live_server: RunningServer,
) -> None:
    body = {"prompt": "hello", "max_tokens": 2}
    assert httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=60).status_code == 200
    with management_client(live_server, timeout=30) as http:
        assert http.get("/v1/status").json()["gateway"]["inflight"] == 0
