"""Structured logs: JSON lines with the request id on every line, prompts only when enabled."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from server.core.service import Timing
from server.core.types import (
    ChatMessage,
    ChatPrompt,
    GenerationRequest,
    Sampling,
    TextPrompt,
    Usage,
)
from server.http.context import request_id_var
from server.observability.logs import RequestLog, configure_logging
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
