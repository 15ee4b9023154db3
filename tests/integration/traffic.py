"""Mixed-protocol traffic for the drain tests: long requests of every protocol, each checked for
a complete, well-formed answer, and the 503 shape each protocol gives a refused request."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.serverproc import CERTS, RunningServer

PROMPT = "the gateway keeps every stream alive while it drains"
BASE = "tiny"  # the demo's base model; the senders below take an adapter's name instead


def management_tls() -> ssl.SSLContext:
    """The test listener's management plane wants a client certificate (mTLS)."""
    context = ssl.create_default_context(cafile=str(CERTS / "ca.pem"))
    context.load_cert_chain(str(CERTS / "client.pem"), str(CERTS / "client.key"))
    return context


def management_client(server: RunningServer, **kwargs: Any) -> httpx.Client:
    return httpx.Client(base_url=server.management_url, verify=management_tls(), **kwargs)


def async_management_client(server: RunningServer, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.management_url, verify=management_tls(), **kwargs)


@dataclass
class Outcome:
    kind: str
    started: asyncio.Event = field(default_factory=asyncio.Event)
    status: int | None = None
    events: list[Any] = field(default_factory=list)  # parsed stream events, or the JSON body
    error: str | None = None  # a transport failure, or an error event inside the stream


def sse_payloads(text: str) -> list[str]:
    return [
        line.removeprefix("data:").strip() for line in text.split("\n") if line.startswith("data:")
    ]


async def _stream(
    http: httpx.AsyncClient, outcome: Outcome, path: str, body: dict[str, Any], nul: bool = False
) -> None:
    buffer = ""
    async with http.stream("POST", path, json=body) as response:
        outcome.status = response.status_code
        async for chunk in response.aiter_text():
            outcome.started.set()
            buffer += chunk
    if outcome.status != 200:
        outcome.events.append(json.loads(buffer))
        return
    pieces = buffer.split("\0") if nul else sse_payloads(buffer)
    for piece in (p for p in pieces if p.strip()):
        outcome.events.append(piece if piece == "[DONE]" else json.loads(piece))
    if any(isinstance(e, dict) and "error" in e for e in outcome.events):
        outcome.error = f"error event: {outcome.events[-1]}"


async def _json(http: httpx.AsyncClient, outcome: Outcome, path: str, body: dict[str, Any]) -> None:
    outcome.started.set()
    response = await http.post(path, json=body)
    outcome.status = response.status_code
    outcome.events.append(response.json())


Sender = Callable[[httpx.AsyncClient, Outcome, int], Awaitable[None]]


async def openai_chat_stream(
    http: httpx.AsyncClient, out: Outcome, tokens: int, model: str = BASE
) -> None:
    await _stream(
        http,
        out,
        "/v1/chat/completions",
        {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "stream": True,
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )


async def openai_completion(
    http: httpx.AsyncClient, out: Outcome, tokens: int, model: str = BASE
) -> None:
    await _json(
        http,
        out,
        "/v1/completions",
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": tokens,
            "ignore_eos": True,
        },
    )


async def tgi_generate_stream(
    http: httpx.AsyncClient, out: Outcome, tokens: int, model: str = BASE
) -> None:
    parameters: dict[str, Any] = {"max_new_tokens": tokens, "details": True}
    if model != BASE:
        parameters["adapter_id"] = model
    await _stream(http, out, "/generate_stream", {"inputs": PROMPT, "parameters": parameters})


async def triton_generate_stream(http: httpx.AsyncClient, out: Outcome, tokens: int) -> None:
    await _stream(
        http,
        out,
        "/v2/models/tiny/generate_stream",
        {
            "text_input": PROMPT,
            "stream": True,
            "parameters": {"max_tokens": tokens, "ignore_eos": True},
        },
    )


async def triton_generate(
    http: httpx.AsyncClient, out: Outcome, tokens: int, model: str = BASE
) -> None:
    await _json(
        http,
        out,
        f"/v2/models/{model}/generate",
        {"text_input": PROMPT, "parameters": {"max_tokens": tokens, "ignore_eos": True}},
    )


async def mindie_vllm_stream(http: httpx.AsyncClient, out: Outcome, tokens: int) -> None:
    await _stream(
        http,
        out,
        "/generate",
        {
            "prompt": PROMPT,
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream": True,
        },
        nul=True,
    )


MIX: tuple[tuple[str, Sender, int], ...] = (
    ("openai-chat-stream", openai_chat_stream, 8),
    ("openai-completion", openai_completion, 6),
    ("tgi-generate-stream", tgi_generate_stream, 8),
    ("triton-generate-stream", triton_generate_stream, 5),
    ("mindie-generate-stream", mindie_vllm_stream, 5),
)


def complete(outcome: Outcome, tokens: int) -> str | None:
    """None when the answer is whole and well-formed for its protocol, else what is wrong."""
    if outcome.error or outcome.status != 200:
        return f"{outcome.kind}: status {outcome.status}, {outcome.error}"
    events = outcome.events
    checks = {
        "openai-chat-stream": lambda: (
            events[-1] == "[DONE]"
            and events[-2]["usage"]["completion_tokens"] == tokens
            and events[-3]["choices"][0]["finish_reason"] == "length"
        ),
        "openai-completion": lambda: (
            events[0]["usage"]["completion_tokens"] == tokens
            and events[0]["choices"][0]["finish_reason"] == "length"
        ),
        "tgi-generate-stream": lambda: (
            events[-1]["generated_text"] is not None
            and events[-1]["details"]["generated_tokens"] == len(events)
            and (events[-1]["details"]["finish_reason"] != "length" or len(events) == tokens)
        ),
        "triton-generate-stream": lambda: events[-1]["done"] is True and len(events) >= 1,
        "triton-generate": lambda: isinstance(events[0]["text_output"], str),
        "mindie-generate-stream": lambda: all("text" in e for e in events) and len(events) >= 1,
    }
    try:
        ok = checks[outcome.kind]()
    except (KeyError, IndexError, TypeError) as exc:
        return f"{outcome.kind}: malformed ({exc!r}): {str(events)[-400:]}"
    return None if ok else f"{outcome.kind}: incomplete: {str(events)[-400:]}"


def launch(http: httpx.AsyncClient, tokens: int) -> tuple[list[Outcome], list[asyncio.Task[None]]]:
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task[None]] = []
    for kind, sender, count in MIX:
        for _ in range(count):
            outcome = Outcome(kind)
            outcomes.append(outcome)
            tasks.append(asyncio.create_task(_guard(sender(http, outcome, tokens), outcome)))
    return outcomes, tasks


async def run_one(http: httpx.AsyncClient, kind: str, sender: Sender, tokens: int) -> Outcome:
    """One request of `kind`; its outcome, transport failures included."""
    outcome = Outcome(kind)
    await _guard(sender(http, outcome, tokens), outcome)
    return outcome


async def _guard(work: Awaitable[None], outcome: Outcome) -> None:
    try:
        await work
    except httpx.HTTPError as exc:
        outcome.error = f"transport: {exc!r}"
    finally:
        outcome.started.set()


# (path, body, check of the JSON error body) for one refused request per protocol
REFUSALS: tuple[tuple[str, dict[str, Any], Callable[[Any], bool]], ...] = (
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "max_tokens": 2},
        lambda b: b["error"]["code"] == 503,
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        lambda b: b["error"]["code"] == 503,
    ),
    ("/generate", {"inputs": "hi"}, lambda b: b["error_type"] == "unhealthy"),
    ("/generate_stream", {"inputs": "hi"}, lambda b: b["error_type"] == "unhealthy"),
    ("/v2/models/tiny/generate", {"text_input": "hi"}, lambda b: isinstance(b["error"], str)),
    ("/infer", {"inputs": "hi"}, lambda b: b["error_type"] == "Service Unavailable"),
    (  # Anthropic's status for "cannot take it now" is 529
        "/v1/messages",
        {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        lambda b: b["error"]["type"] == "overloaded_error",
    ),
)
ANTHROPIC_OVERLOADED = {"/v1/messages": 529}


async def refused_while_draining(http: httpx.AsyncClient) -> list[str]:
    """Every protocol answers a new request with 503 (Anthropic: 529), Retry-After and its own
    error shape."""
    problems = []
    for path, body, shape in REFUSALS:
        response = await http.post(path, json=body)
        try:
            shaped = shape(response.json())
        except (KeyError, TypeError, ValueError):
            shaped = False
        status = ANTHROPIC_OVERLOADED.get(path, 503)
        if response.status_code != status or "retry-after" not in response.headers or not shaped:
            problems.append(f"{path}: {response.status_code} {response.headers} {response.text}")
    return problems
