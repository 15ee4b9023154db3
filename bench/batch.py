"""Batch first byte: how long a streamed OpenAI `/v1/completions` request with a list of prompts
waits for its first byte, next to the same request with one prompt.

One request at a time on a keep-alive connection opened before the clock starts; the clock
runs from writing the request. Three instants per request:

- first byte: the response head (status line and headers, which the server writes in one piece
  before any body) has arrived;
- first event: the first SSE event carrying a choice, i.e. a token of any prompt;
- all started: every prompt (choice index) has had its first token;

and the whole response. A request is `ok` when it answered 200 without an in-band error and
every prompt (choice index 0..n-1, and no other) streamed at least one event; the figures of
the others are recorded but not used. Events per choice are recorded, not required to equal
`max_tokens` (a server may merge a choice's tokens into fewer events).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from bench.http import Connection, HttpError, Target
from bench.protocols import OPENAI_COMPLETIONS, Ask

PATH = "/v1/completions"


def batch_body(prompts: Sequence[str], max_tokens: int, model: str = "tiny") -> bytes:
    """The Python client's streamed completion request (bench/protocols.py), with `prompt` a
    list when there is more than one prompt, the plain string otherwise."""
    ask = Ask(prompt=prompts[0], max_tokens=max_tokens, stream=True, model=model, base=model)
    body = OPENAI_COMPLETIONS.body(ask)
    body["prompt"] = list(prompts) if len(prompts) > 1 else prompts[0]
    return orjson.dumps(body)


@dataclass(slots=True)
class BatchTiming:
    """One request; times in seconds from writing it."""

    prompts: int
    max_tokens: int
    status: int = 0
    first_byte_s: float | None = None
    first_event_s: float | None = None
    all_started_s: float | None = None
    total_s: float | None = None
    token_events: dict[int, int] = field(default_factory=dict)  # choice index -> events
    error: str | None = None

    @property
    def ok(self) -> bool:
        every = set(self.token_events) == set(range(self.prompts))
        return self.status == 200 and self.error is None and every

    def row(self) -> dict[str, Any]:
        out = asdict(self)
        out["token_events"] = {str(k): v for k, v in sorted(self.token_events.items())}
        out["choices"] = len(self.token_events)
        out["ok"] = self.ok
        return out


class _Splitter:
    """SSE events of a completion stream: the first event with a choice, each choice's first
    token, token events per choice, in-band errors."""

    def __init__(self, timing: BatchTiming) -> None:
        self.timing = timing
        self.buffer = bytearray()

    def feed(self, chunk: bytes, now: float) -> None:
        self.buffer += chunk
        while (end := self.buffer.find(b"\n\n")) >= 0:
            raw = bytes(self.buffer[:end])
            del self.buffer[: end + 2]
            self.event(raw, now)

    def event(self, raw: bytes, now: float) -> None:
        payload = next(
            (line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")), None
        )
        if payload is None or payload == b"[DONE]":
            return
        timing = self.timing
        data = orjson.loads(payload)
        if isinstance(data, dict) and "error" in data:
            timing.error = str(data["error"])[:200]
            return
        for choice in data.get("choices") or ():
            index = int(choice.get("index", 0))
            if timing.first_event_s is None:
                timing.first_event_s = now
            timing.token_events[index] = timing.token_events.get(index, 0) + 1
            if timing.all_started_s is None and len(timing.token_events) >= timing.prompts:
                timing.all_started_s = now


async def time_batch(
    connection: Connection, prompts: Sequence[str], max_tokens: int, model: str = "tiny"
) -> BatchTiming:
    """Send one streamed completion for `prompts` on `connection` and time it."""
    body = batch_body(prompts, max_tokens, model)
    timing = BatchTiming(prompts=len(prompts), max_tokens=max_tokens)
    splitter = _Splitter(timing)
    t0 = time.perf_counter()
    try:
        response = await connection.request("POST", PATH, body)
        timing.first_byte_s = time.perf_counter() - t0
        timing.status = response.status
        if response.status != 200:
            timing.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
            return timing
        async for chunk in response.chunks():
            splitter.feed(chunk, time.perf_counter() - t0)
        timing.total_s = time.perf_counter() - t0
    except (HttpError, ValueError) as exc:
        timing.error = str(exc)[:200]
        await connection.close()
    return timing


async def time_batches(
    target: Target,
    prompts: Sequence[str],
    sizes: Sequence[int],
    *,
    reps: int,
    max_tokens: int,
    warmup: bool = True,
) -> list[tuple[int, BatchTiming]]:
    """`reps` rounds of one request per size (the order rotates per round, so no size always
    runs first), after one unrecorded request per size; returns (round, timing) pairs."""
    connection = Connection(target)
    await connection.open()
    out: list[tuple[int, BatchTiming]] = []
    try:
        if warmup:
            for size in sizes:
                await time_batch(connection, prompts[:size], max_tokens)
        for rep in range(reps):
            shift = rep % len(sizes)
            for size in (*sizes[shift:], *sizes[:shift]):
                out.append((rep, await time_batch(connection, prompts[:size], max_tokens)))
    finally:
        await connection.close()
    return out
