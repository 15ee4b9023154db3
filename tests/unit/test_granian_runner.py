"""The granian runner's settings and its ASGI edge (server/runtime/granian_runner.py): what it
refuses at start, and the head limits, receive deadline and send timeout it adds at ASGI.
Served over real sockets with mutual TLS: tests/integration/test_granian_runner.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from server.runtime.granian_runner import (
    GRANIAN_SERIES,
    HeadAndDeadlines,
    check_granian,
    check_limits,
    head_refusal,
    tls_arguments,
)
from server.runtime.limits import HttpLimits
from server.runtime.listeners import build_server, plan_listeners
from server.runtime.tls import tls_files
from server.settings import Settings, SettingsError, settings_from_config

CERTS = Path(__file__).resolve().parents[2] / "certs"
LIMITS = HttpLimits(
    max_header_bytes=1024, max_header_count=4, receive_timeout_s=0.05, send_timeout_s=0.05,
    max_connections=3,
)


def settings(tmp_path: Path, **server: Any) -> Settings:
    tls = {"tlsCaPath": str(CERTS), "tlsCert": str(CERTS / "server.pem"),
           "tlsPk": str(CERTS / "server.key"), "tlsCrlPath": str(CERTS)}
    return settings_from_config({"ServerConfig": {**tls, **server}}, base_dir=tmp_path)


# ---- settings ---------------------------------------------------------------------------------
def test_uvicorn_is_the_default_runner_and_granian_is_chosen_by_name(tmp_path: Path) -> None:
    assert settings(tmp_path).server.http_runner == "uvicorn"
    assert settings(tmp_path, httpRunner="granian").server.http_runner == "granian"


def test_an_unknown_runner_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"ServerConfig\.httpRunner"):
        settings(tmp_path, httpRunner="gunicorn")


def test_the_runner_setting_builds_that_servers_listeners(tmp_path: Path) -> None:
    from server.runtime.granian_runner import GranianServer
    from server.runtime.listeners import GatewayServer

    for runner, kind in (("uvicorn", GatewayServer), ("granian", GranianServer)):
        chosen = settings(tmp_path, httpRunner=runner)
        listeners = plan_listeners(chosen)
        assert {type(build_server(_app, ln, chosen)) for ln in listeners} == {kind}


def test_another_granian_minor_is_refused_with_a_fix() -> None:
    check_granian()  # the installed one is the pinned one
    check_granian(f"{GRANIAN_SERIES}.99")
    with pytest.raises(SettingsError, match=r"granian 2\.99\.0 is installed.*Fix: pip"):
        check_granian("2.99.0")


def test_more_headers_than_hyper_takes_is_refused_not_cut_silently() -> None:
    check_limits(replace(LIMITS, max_header_count=100))
    with pytest.raises(SettingsError, match=r"maxHeaderCount 101.*at most 100"):
        check_limits(replace(LIMITS, max_header_count=101))


def test_tls_files_go_to_granian_checked_as_on_uvicorns_path(tmp_path: Path) -> None:
    chosen = settings(tmp_path, tlsCrlFiles=["crl.pem"])
    files = tls_files(chosen, "data")
    assert files is not None
    arguments = tls_arguments(files)
    assert arguments["ssl_client_verify"] is True
    assert arguments["ssl_protocol_min"] == "tls1.2"
    assert arguments["ssl_crl"] == [str(CERTS / "crl.pem")]
    missing = tls_files(settings(tmp_path, tlsCert="/nonexistent.pem"), "data")
    assert missing is not None
    with pytest.raises(SettingsError, match="tlsCert"):
        tls_arguments(missing)


def test_two_ca_files_are_refused_with_a_fix(tmp_path: Path) -> None:
    files = tls_files(settings(tmp_path, tlsCaFile=["ca.pem", "rogue-ca.pem"]), "data")
    assert files is not None
    with pytest.raises(SettingsError, match=r"one CA file\. Fix: concatenate"):
        tls_arguments(files)


def test_an_encrypted_key_reaches_granian_decrypted_in_memory_only(tmp_path: Path) -> None:
    chosen = settings(
        tmp_path, tlsPk=str(CERTS / "server-encrypted.key"),
        tlsPkPwd=str(CERTS / "server-key-password.txt"),
    )
    files = tls_files(chosen, "data")
    assert files is not None
    key = tls_arguments(files)["ssl_key"]
    assert key.startswith("/proc/self/fd/")
    assert b"BEGIN PRIVATE KEY" in Path(key).read_bytes()


# ---- the ASGI edge ----------------------------------------------------------------------------
async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def scope(path: str = "/v1/models", headers: int = 1, query: bytes = b"") -> dict[str, Any]:
    return {"type": "http", "path": path, "raw_path": path.encode(), "query_string": query,
            "headers": [(b"x-%d" % i, b"v") for i in range(headers)]}


def test_head_limits_count_as_uvicorns_path_counts() -> None:
    assert head_refusal(scope(), LIMITS) is None
    assert head_refusal(scope(headers=5), LIMITS) == (431, "Too many request header fields")
    assert head_refusal(scope(path="/" + "a" * 1100), LIMITS) == (414, "URI too long")
    big = scope()
    big["headers"] = [(b"x", b"v" * 1100)]
    assert head_refusal(big, LIMITS) == (431, "Request header fields too large")


def run(app: Any, receive: Any, request: dict[str, Any]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(HeadAndDeadlines(app, LIMITS)(request, receive, send))
    return sent


def test_a_refused_head_gets_its_status_and_the_connection_closed() -> None:
    sent = run(_app, None, scope(headers=5))
    assert sent[0]["status"] == 431
    assert (b"connection", b"close") in sent[0]["headers"]


def test_a_body_that_does_not_arrive_in_time_gets_408() -> None:
    seen: list[dict[str, Any]] = []

    async def never() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError

    async def reader(scope: Any, receive: Any, send: Any) -> None:
        seen.append(await receive())
        await send({"type": "http.response.start", "status": 400, "headers": []})

    sent = run(reader, never, scope())
    assert seen == [{"type": "http.disconnect"}]
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [408]


def test_a_stream_the_client_leaves_unread_drops_the_client() -> None:
    async def stalled_send(message: dict[str, Any]) -> None:
        if message.get("more_body"):
            await asyncio.Event().wait()

    async def streamer(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})

    with pytest.raises(ConnectionAbortedError):
        asyncio.run(HeadAndDeadlines(streamer, LIMITS)(scope(), None, stalled_send))


def test_a_handler_that_never_reads_its_body_may_outlast_the_receive_deadline() -> None:
    """GET /stopService waits for the drain: the deadline bounds only a wait for the body."""

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(LIMITS.receive_timeout_s * 4)
        await _app(scope, receive, send)

    sent = run(slow, None, scope())
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [200]
