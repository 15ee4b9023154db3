"""Structured logs: JSON lines with the request id on every line, prompts only when enabled."""

from __future__ import annotations

import io
import json
import logging
import re
import time
from collections.abc import Iterator

import pytest

from server.core.lifecycle import log_phase
from server.core.service import Timing
from server.core.types import (
    ChatMessage,
    ChatPrompt,
    GenerationRequest,
    Sampling,
    TextPrompt,
    Usage,
)
from server.http.context import AccessNote, request_id_var
from server.observability.logs import RequestLog, access_line, configure_logging, log_settings
from tests.unit.gateway_kit import client, make_gateway

SECRET_PROMPT = "my card number is 4111 1111 1111 1111"


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """Configure the root logger as the CLI does, writing into a buffer; restore it afterwards."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    configure_logging("DEBUG", json_format=True)
    stream = io.StringIO()
    handler = root.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    try:
        yield stream
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


def lines(stream: io.StringIO) -> list[dict[str, str]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def request(prompt: str = SECRET_PROMPT) -> GenerationRequest:
    return GenerationRequest(
        request_id="r1",
        model="",
        prompt=TextPrompt(prompt),
        sampling=Sampling(max_new_tokens=2),
        protocol="tgi",
    )


def test_json_lines_carry_the_request_id_of_their_context(captured: io.StringIO) -> None:
    logger = logging.getLogger("gateway.test")
    logger.info("outside")
    token = request_id_var.set("req-42")
    try:
        logger.warning("inside %s", "a request")
    finally:
        request_id_var.reset(token)
    outside, inside = lines(captured)
    assert outside["request_id"] == "-"
    assert (inside["request_id"], inside["level"], inside["message"]) == (
        "req-42",
        "WARNING",
        "inside a request",
    )
    assert inside["time"].endswith("Z") and inside["logger"] == "gateway.test"


def test_prompts_are_not_logged_unless_enabled(captured: io.StringIO) -> None:
    quiet, chatty = RequestLog(level=logging.INFO), RequestLog(log_prompts=True, level=logging.INFO)
    quiet.admitted(request())
    assert SECRET_PROMPT not in captured.getvalue()
    chatty.admitted(request())
    chat = ChatPrompt(messages=(ChatMessage(role="user", content="hello chat"),))
    chatty.admitted(
        GenerationRequest(
            request_id="r2",
            model="",
            prompt=chat,
            sampling=Sampling(),
            protocol="openai",
        )
    )
    assert SECRET_PROMPT in captured.getvalue()
    assert "user: hello chat" in captured.getvalue()


def test_finished_line_reports_outcome_tokens_and_ttft(captured: io.StringIO) -> None:
    RequestLog(level=logging.INFO).finished(
        request(),
        error_type=None,
        usage=Usage(prompt_tokens=3, completion_tokens=2),
        timing=Timing(seconds=0.5, first_token_s=0.125),
    )
    (line,) = lines(captured)
    assert "outcome=ok" in line["message"] and "completion_tokens=2" in line["message"]
    assert "ttft_ms=125.0" in line["message"]


@pytest.mark.anyio
async def test_access_and_request_lines_of_one_http_request_share_its_id(
    captured: io.StringIO,
) -> None:
    gateway = make_gateway(overrides={"LoggingConfig": {"accessLog": True}})
    async with client(gateway, "data") as http:
        response = await http.post(
            "/generate",
            json={"inputs": SECRET_PROMPT, "parameters": {"max_new_tokens": 2}},
            headers={"x-request-id": "trace-7"},
        )
    assert response.headers["x-request-id"] == "trace-7"
    ours = [line for line in lines(captured) if line["logger"].startswith("gateway")]
    assert {line["logger"] for line in ours} >= {"gateway.access", "gateway.requests"}
    assert all(line["request_id"] == "trace-7" for line in ours)
    assert SECRET_PROMPT not in captured.getvalue()


def test_settings_are_logged_one_key_per_line_with_their_source(captured: io.StringIO) -> None:
    root = logging.getLogger()
    root.handlers[0].setFormatter(logging.Formatter("%(message)s"))
    tree = {"ServerConfig": {"port": 8000, "ipAddress": "127.0.0.1", "tlsCaFile": ["ca.pem"]},
            "engine": "vllm", "LoraConfig": {"adapters": {}}}
    log_settings(logging.getLogger("gateway"), tree, {"ServerConfig.port": "cli"},
                 json_format=False)
    assert captured.getvalue().splitlines() == [
        "setting ServerConfig.port = 8000 (cli)",
        'setting ServerConfig.ipAddress = "127.0.0.1" (default)',
        'setting ServerConfig.tlsCaFile = ["ca.pem"] (default)',
        'setting engine = "vllm" (default)',
        "setting LoraConfig.adapters = {} (default)",
    ]


def test_settings_in_json_are_one_record_with_the_tree(captured: io.StringIO) -> None:
    tree = {"ServerConfig": {"port": 8000}}
    log_settings(logging.getLogger("gateway"), tree, {"ServerConfig.port": "env"},
                 json_format=True)
    (line,) = [json.loads(text) for text in captured.getvalue().splitlines()]
    assert line["message"] == "settings"
    assert line["settings"] == tree and line["sources"] == {"ServerConfig.port": "env"}


def test_uvicorn_start_lines_are_quiet_but_its_warnings_show(captured: io.StringIO) -> None:
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.info("Uvicorn running on http://127.0.0.1:1 (Press CTRL+C to quit)")
    uvicorn_log.warning("Invalid HTTP request received.")
    assert [line["message"] for line in lines(captured)] == ["Invalid HTTP request received."]


def test_a_start_up_phase_is_one_line_with_its_seconds(captured: io.StringIO) -> None:
    since = time.monotonic() - 1.5
    after = log_phase(logging.getLogger("gateway"), "engine start", since, "vLLM 0.32.0")
    (line,) = lines(captured)
    assert re.fullmatch(r"start-up engine start: 1\.5\ds, vLLM 0\.32\.0", line["message"])
    assert after >= since + 1.5


def test_access_line_names_protocol_route_status_adapter_tokens_ttft_duration() -> None:
    note = AccessNote()
    note.add("a1", 8, 16, 0.0123)
    note.add(None, 8, 16, 0.5)  # a second generation of the same request (a batch)
    scope = {"method": "POST", "path": "/v1/chat/completions"}
    assert access_line(scope, "openai", "/v1/chat/completions", 200, 0.2105, note) == (
        "POST /v1/chat/completions 200 protocol=openai route=/v1/chat/completions adapter=a1 "
        "prompt_tokens=16 completion_tokens=32 ttft_ms=12.3 ms=210.5"
    )
    scope = {"method": "GET", "path": "/v2/models/tiny/ready"}
    assert access_line(scope, "kserve_v2", "/v2/models/{model}/ready", 200, 0.001, None) == (
        "GET /v2/models/tiny/ready 200 protocol=kserve_v2 route=/v2/models/{model}/ready ms=1.0"
    )


@pytest.mark.anyio
async def test_one_access_line_per_request_carries_its_generation(
    captured: io.StringIO,
) -> None:
    gateway = make_gateway(overrides={"LoggingConfig": {"accessLog": True}})
    async with client(gateway, "data") as http:
        response = await http.post(
            "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}}
        )
    assert response.status_code == 200
    (access,) = [line for line in lines(captured) if line["logger"] == "gateway.access"]
    assert access["message"].startswith("POST /generate 200 protocol=tgi route=/generate ")
    assert "adapter=- " in access["message"] and "completion_tokens=3" in access["message"]
    assert re.search(r" ttft_ms=[\d.]+ ms=[\d.]+$", access["message"])
