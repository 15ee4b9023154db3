"""Adding a protocol touches only protocols/ (docs/architecture.md, "Adding a protocol").

A tiny "echo" protocol is defined here and nowhere else: a wire model, a translator to the core
`GenerationRequest` and back, a row table on the shared `ErrorTable`, its own error envelope
(which also renders its 503 while the engine starts), one route and a start-up hook, all
declared by one `ProtocolSpec`. It plugs in as a real one does, by joining `protocols.REGISTRY`;
nothing in server/ is edited or told about it. The gateway is then driven through its own
listener apps over an ASGI HTTP client, on the fake engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

import protocols
from protocols.common.errors import ErrorTable
from server.core.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    ServiceUnavailable,
)
from server.core.lifecycle import Lifecycle
from server.core.types import GenerationRequest, GenerationResult, Sampling, TextPrompt
from server.gateway import Gateway, register_startup_adapters, starting_answers
from server.http.body import json_response, parse_model, read_json, retry_headers
from server.http.context import ProtocolContext, current_request_id
from server.http.routes import DATA, MANAGEMENT, Answer, Doc, ProtocolSpec, Route, RouteList
from server.runtime.process import StartingApp
from tests.unit.gateway_kit import make_gateway

pytestmark = pytest.mark.anyio

NAME = "echo"


# ---- the protocol: everything a protocol package would hold --------------------------------


class EchoBody(BaseModel):
    """The wire model (a protocol's schema.py)."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1)
    model: str = ""  # "" = the base model
    words: int = Field(default=4, ge=1, le=64)


def to_generation(body: EchoBody, request_id: str) -> GenerationRequest:
    """Wire → core (a protocol's translate.py)."""
    return GenerationRequest(
        request_id=request_id,
        model=body.model,
        prompt=TextPrompt(body.text),
        sampling=Sampling(max_new_tokens=body.words),
        protocol=NAME,
    )


def to_wire(result: GenerationResult) -> dict[str, Any]:
    """Core → wire: the protocol's own answer shape."""
    return {"echo": result.choices[0].text, "words": result.usage.completion_tokens}


# (status, kind) along the domain errors' MRO, on the shared table mechanism (errors.py)
TABLE: ErrorTable[tuple[int, str]] = ErrorTable(
    {
        InvalidRequest: (400, "bad_echo"),
        ModelNotFound: (404, "unknown_model"),
        Overloaded: (429, "busy"),
        ServiceUnavailable: (503, "not_yet"),
    },
    default=(500, "echo_failed"),
)


def render(exc: GatewayError) -> Response:
    status, kind = TABLE[exc]
    return json_response(
        {"echo_error": {"kind": kind, "says": exc.message, "field": exc.param}},
        status,
        retry_headers(exc),
    )


def routes(ctx: ProtocolContext) -> list[Route]:
    """The data routes (a protocol's routes.py)."""
    out = RouteList(owner=NAME, render=render)

    async def echo(request: Request) -> Answer:
        body = parse_model(EchoBody, await read_json(request, ctx.max_body_bytes))
        result = await ctx.service.generate(to_generation(body, current_request_id()))
        return json_response(to_wire(result))

    out.post("/echo", echo, doc=Doc(summary="The prompt's words, as the engine says them",
                                     body=EchoBody))
    return out.routes


STARTED: list[ProtocolContext] = []


async def startup(ctx: ProtocolContext) -> None:
    STARTED.append(ctx)


SPEC = ProtocolSpec(
    name=NAME, render=render, routes=routes, paths=frozenset({"/echo"}), startup=startup
)


# ---- plugged in ----------------------------------------------------------------------------


@pytest.fixture
def plugged_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One more entry in the registry: what a sixth package's line in protocols/__init__.py
    does. The server reads the registry whenever it assembles, never a list of its own."""
    monkeypatch.setattr(protocols, "REGISTRY", (*protocols.REGISTRY, SPEC))
    STARTED.clear()
    yield


@pytest.fixture
async def gateway(plugged_in: None) -> Gateway:
    built = make_gateway()
    await register_startup_adapters(built)  # runs every spec's start-up hook
    return built


@pytest.fixture
async def http(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=gateway.app((DATA,)))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


async def test_the_echo_protocol_runs_a_generation_on_the_engine(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    response = await http.post("/echo", json={"text": "one two three", "words": 4})
    assert response.status_code == 200, response.text
    # the fake engine says the prompt's words in turn, each followed by a space
    assert response.json() == {"echo": "one two three one ", "words": 4}
    assert [gateway.context] == STARTED
    served = gateway.metrics.registry.get_sample_value(
        "gateway_http_requests_total", {"protocol": NAME, "endpoint": "/echo", "status": "200"}
    )
    assert served == 1.0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"text": ""}, "text"),
        ({"text": "hi", "words": 0}, "words"),
        ({"text": "hi", "louder": True}, "louder"),
        ([1, 2], None),
    ],
)
async def test_bad_input_is_a_400_in_the_echo_shape(
    http: httpx.AsyncClient, body: object, field: str | None
) -> None:
    response = await http.post("/echo", json=body)
    assert response.status_code == 400
    error = response.json()["echo_error"]
    assert (error["kind"], error["field"]) == ("bad_echo", field)
    assert error["says"]


async def test_a_body_that_is_not_json_is_a_400_in_the_echo_shape(
    http: httpx.AsyncClient,
) -> None:
    response = await http.post("/echo", content=b"{not json")
    assert response.status_code == 400
    assert response.json()["echo_error"]["kind"] == "bad_echo"


async def test_an_unknown_model_is_a_404_in_the_echo_shape(http: httpx.AsyncClient) -> None:
    response = await http.post("/echo", json={"text": "hi", "model": "ghost"})
    assert response.status_code == 404
    error = response.json()["echo_error"]
    assert error["kind"] == "unknown_model"
    assert "ghost" in error["says"]


async def test_the_other_protocols_still_answer_beside_it(http: httpx.AsyncClient) -> None:
    openai = await http.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2})
    assert openai.status_code == 200
    assert openai.json()["choices"][0]["text"] == "a b "
    tgi = await http.post("/generate", json={"inputs": "a b", "parameters": {"max_new_tokens": 2}})
    assert tgi.status_code == 200
    assert list(tgi.json()) == ["generated_text"]  # TGI's shape (its prompt goes as token ids)
    bad = await http.post("/v1/completions", json={"prompt": "a b", "n": 0})
    assert bad.status_code == 400
    assert set(bad.json()["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape


async def test_its_route_is_in_the_data_listeners_openapi_document(gateway: Gateway) -> None:
    transport = httpx.ASGITransport(app=gateway.app((MANAGEMENT,)))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as management:
        response = await management.get("/openapi.json", params={"listener": DATA})
    document = response.json()
    operation = document["paths"]["/echo"]["post"]
    assert operation["tags"] == [NAME]
    assert operation["summary"] == "The prompt's words, as the engine says them"


async def test_while_the_engine_starts_it_renders_its_own_503(plugged_in: None) -> None:
    app = StartingApp(Lifecycle(), starting_answers((DATA,)))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        echo = await client.post("/echo", json={"text": "hi"})
        openai = await client.post("/v1/completions", json={"prompt": "hi"})
    assert echo.status_code == 503
    assert echo.json()["echo_error"]["kind"] == "not_yet"
    assert echo.headers["retry-after"] == "5"
    assert (openai.status_code, openai.json()["error"]["code"]) == (503, 503)
