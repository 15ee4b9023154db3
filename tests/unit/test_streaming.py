"""The one streaming path (server/http/streaming.py), proven once for every protocol's streams:
a domain error, an unexpected exception and the engine dying mid-stream become that protocol's
in-band error; a client that disconnects aborts the engine request; an encoder that raises is
contained; every exit closes the events and frees the admission slot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from starlette.types import Message, Scope

from server.core.errors import EngineError, GatewayError, ServiceUnavailable
from server.core.types import Delta, Done, GenerationEvent, Started, Usage
from server.engines.fake import FakeScript
from server.gateway import Gateway
from server.http import jsonio
from server.http.streaming import EventStreamAnswer
from tests.unit.gateway_kit import make_gateway

pytestmark = pytest.mark.anyio


@dataclass(frozen=True, slots=True)
class Stream:
    name: str
    path: str
    body: dict[str, Any]
    error_marker: bytes  # what the protocol's in-band error frame contains
    ends_with: bytes = b""  # what always follows the error (OpenAI's terminator)
    config: dict[str, Any] | None = None  # config.json overrides the stream needs


STREAMS = [
    Stream("openai-chat", "/v1/chat/completions",
           {"model": "tiny", "messages": [{"role": "user", "content": "a b c"}],
            "stream": True, "max_tokens": 8},
           b'data: {"error":{', b"data: [DONE]\n\n"),
    Stream("openai-completions", "/v1/completions",
           {"prompt": "a b c", "stream": True, "max_tokens": 8},
           b'data: {"error":{', b"data: [DONE]\n\n"),
    Stream("tgi", "/generate_stream",
           {"inputs": "a b c", "parameters": {"max_new_tokens": 8}}, b'data: {"error":"'),
    Stream("tgi-compat", "/", {"inputs": "a b c", "stream": True,
                               "parameters": {"max_new_tokens": 8}}, b'data: {"error":"'),
    Stream("triton", "/v2/models/tiny/generate_stream",
           {"text_input": "a b c", "stream": True, "max_tokens": 8}, b'data: {"error":'),
    Stream("mindie-infer", "/infer",
           {"inputs": "a b c", "stream": True, "parameters": {"max_new_tokens": 8}},
           b'data: {"error":"'),
    Stream("mindie-generate", "/generate",
           {"prompt": "a b c", "stream": True, "max_tokens": 8}, b'{"error":"'),
    Stream("djl", "/invocations",  # LMI's async mode: vLLM's error object
           {"inputs": "a b c", "stream": True, "parameters": {"max_new_tokens": 8}},
           b'{"error":{"message":'),
    Stream("djl-rolling-batch", "/invocations",
           {"inputs": "a b c", "stream": True, "parameters": {"max_new_tokens": 8}},
           b'"finish_reason":"error"', config={"ProtocolConfig": {"rollingBatch": "vllm"}}),
    Stream("anthropic", "/v1/messages",
           {"model": "tiny", "messages": [{"role": "user", "content": "a b c"}],
            "stream": True, "max_tokens": 8},
           b'event: error\ndata: {"type":"error","error":{'),
]
IDS = [s.name for s in STREAMS]


@dataclass
class Exchange:
    status: int
    chunks: list[bytes]

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


async def drive(gateway: Gateway, stream: Stream, *, leave_after: int | None = None) -> Exchange:
    """POST `stream` to the data listener app over raw ASGI; with `leave_after`, the client
    disconnects once that many body chunks arrived."""
    data = jsonio.dumps(stream.body)
    scope: Scope = {
        "type": "http", "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": stream.path, "raw_path": stream.path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 9), "server": ("127.0.0.1", 80),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode())],
    }
    gone = asyncio.Event()
    sent: list[Message] = []
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if leave_after is not None and len(chunks) >= leave_after:
            gone.set()

    await asyncio.wait_for(gateway.app(("data",))(scope, receive, send), 10)
    start = next(m for m in sent if m["type"] == "http.response.start")
    chunks = [m.get("body", b"") for m in sent if m["type"] == "http.response.body"]
    return Exchange(start["status"], [c for c in chunks if c])


def assert_released(gateway: Gateway) -> None:
    assert gateway.service.admission.running == 0
    assert gateway.lifecycle.inflight == 0


@pytest.mark.parametrize("stream", STREAMS, ids=IDS)
async def test_a_stream_that_ends_well_frees_everything(stream: Stream) -> None:
    gateway = make_gateway(overrides=stream.config)
    exchange = await drive(gateway, stream)
    assert exchange.status == 200
    assert stream.error_marker not in exchange.body
    assert_released(gateway)


@pytest.mark.parametrize(
    "failure",
    [EngineError("scripted failure"), ServiceUnavailable("engine is dead: core stopped"),
     RuntimeError("a bug, not a domain error")],
    ids=["domain-error", "engine-death", "unexpected-exception"],
)
@pytest.mark.parametrize("stream", STREAMS, ids=IDS)
async def test_a_failure_after_the_first_byte_is_the_protocols_in_band_error(
    stream: Stream, failure: Exception
) -> None:
    gateway = make_gateway(FakeScript(fail_after=2, fail_with=failure), overrides=stream.config)
    exchange = await drive(gateway, stream)
    assert exchange.status == 200  # the head went out with the first tokens
    tail = exchange.chunks[-1]
    assert stream.error_marker in tail, exchange.body
    assert tail.endswith(stream.ends_with)
    if isinstance(failure, RuntimeError):
        assert b"a bug" not in exchange.body  # internals never reach the client
    assert_released(gateway)


@pytest.mark.parametrize("stream", STREAMS, ids=IDS)
async def test_a_client_that_disconnects_aborts_the_engine_request(stream: Stream) -> None:
    gateway = make_gateway(FakeScript(hang_after=2), overrides=stream.config)
    exchange = await drive(gateway, stream, leave_after=1)
    assert exchange.chunks  # it got something before leaving
    assert gateway.engine.aborted  # type: ignore[attr-defined]
    assert_released(gateway)


# ---- the driver on its own ----------------------------------------------------------------------
class Events:
    def __init__(self, events: list[GenerationEvent]) -> None:
        self._events = events
        self.closed = 0

    async def __aiter__(self) -> AsyncIterator[GenerationEvent]:  # type: ignore[override]
        for event in self._events:
            yield event

    async def aclose(self) -> None:
        self.closed += 1


class Format:
    def __init__(self, *, raise_on: int | None = None, error_raises: bool = False) -> None:
        self._raise_on = raise_on
        self._error_raises = error_raises
        self._seen = 0

    def encode(self, event: GenerationEvent) -> bytes:
        self._seen += 1
        if self._seen == self._raise_on:
            raise ValueError("the encoder broke")
        return b"e;"

    def error(self, exc: GatewayError) -> bytes:
        if self._error_raises:
            raise ValueError("so did the error frame")
        return f"error:{exc.message};".encode()

    def end(self) -> bytes:
        return b"end;"


EVENTS: list[GenerationEvent] = [
    Started(prompt_token_ids=(1,)),
    Delta(choice=0, text="a", token_ids=(2,)),
    Done(usage=Usage(prompt_tokens=1, completion_tokens=1)),
]


async def answer_bytes(answer: EventStreamAnswer) -> bytes:
    sent: list[Message] = []

    async def receive() -> Message:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await answer({"type": "http"}, receive, send)
    assert sent[-1] == {"type": "http.response.body", "body": sent[-1]["body"], "more_body": False}
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def test_driver_sends_every_event_then_the_end_and_closes_once() -> None:
    events, outcomes = Events(EVENTS), []
    answer = EventStreamAnswer(events, Format(), on_close=outcomes.append)
    assert await answer_bytes(answer) == b"e;e;e;end;"
    assert events.closed == 1 and outcomes == [True]


async def test_driver_contains_an_encoder_that_raises() -> None:
    events, outcomes = Events(EVENTS), []
    answer = EventStreamAnswer(events, Format(raise_on=2), on_close=outcomes.append)
    body = await answer_bytes(answer)
    assert body == b"e;error:Internal error while streaming the response;"
    assert events.closed == 1 and outcomes == [False]


async def test_driver_ends_the_stream_even_when_the_error_frame_fails() -> None:
    events = Events(EVENTS)
    answer = EventStreamAnswer(events, Format(raise_on=1, error_raises=True))
    assert await answer_bytes(answer) == b""
    assert events.closed == 1
