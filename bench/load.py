"""The load generator: closed loop (fixed concurrency) or open loop (Poisson request rate).

Every window is bounded twice: a fixed number of requests (TGI's argument against the boundary
effect of "as many as possible in T seconds") and a hard time limit, after which requests still
in flight are cancelled and recorded as failures. Each request yields one `Record` with vLLM's
per-request quantities (TTFT, inter-token latencies, end-to-end latency, tokens); `stats.py`
turns records into the figures. The client's own CPU time is measured for every window, because
on this 2-core box the load generator competes with the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from bench.http import Connection, HttpError, Target
from bench.protocols import PROTOCOLS, Ask
from bench.protocols import Protocol as WireProtocol

_GRACE_S = 10.0  # after the time bound, in-flight requests get this long before cancellation


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """One measurement window's settings (all JSON-serialisable except the prompts)."""

    protocol: str
    stream: bool
    max_tokens: int
    prompts: tuple[str, ...]
    models: tuple[str, ...] = ("tiny",)  # round-robin over requests
    base: str = "tiny"
    ignore_eos: bool = True
    concurrency: int | None = 16  # closed loop: requests in flight
    rate: float | None = None  # open loop: Poisson arrivals per second (concurrency = cap)
    requests: int = 200
    duration_s: float = 60.0
    warmup: int = 0
    seed: int = 0
    prompt_len: int | None = None  # the target length the prompts were built for (tokens)
    extra_body: tuple[tuple[str, Any], ...] = ()  # more OpenAI body fields (merged_adapters)

    def settings(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("prompts")
        out["distinct_prompts"] = len(self.prompts)
        out["mode"] = "open" if self.rate is not None else "closed"
        return out

    def ask(self, index: int) -> Ask:
        return Ask(
            prompt=self.prompts[index % len(self.prompts)],
            max_tokens=self.max_tokens,
            stream=self.stream,
            model=self.models[index % len(self.models)],
            base=self.base,
            ignore_eos=self.ignore_eos,
            extra=self.extra_body,
        )


@dataclass(slots=True)
class Record:
    """One request as the client saw it; times in seconds."""

    index: int
    model: str
    ok: bool = False
    status: int = 0
    error: str | None = None
    start: float = 0.0  # since the window began
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    tokens: int = 0
    tokens_reported: bool = False  # False: counted from events, or assumed = max_tokens
    text_events: int = 0
    prompt_tokens: int | None = None


@dataclass(slots=True)
class Window:
    records: list[Record]
    duration_s: float
    client_cpu_s: float
    wall_start: float


class _Reader:
    """Splits a streamed body into events and timestamps them (per received chunk)."""

    def __init__(self, protocol: WireProtocol, record: Record, started: float) -> None:
        self.protocol = protocol
        self.record = record
        self.started = started
        self.last = started
        self.buffer = bytearray()

    def feed(self, chunk: bytes, now: float) -> None:
        self.buffer += chunk
        delimiter = self.protocol.delimiter
        while (end := self.buffer.find(delimiter)) >= 0:
            raw = bytes(self.buffer[:end])
            del self.buffer[: end + len(delimiter)]
            self.handle(raw, now)

    def finish(self, now: float) -> None:
        if self.buffer.strip():
            self.handle(bytes(self.buffer), now)
        self.buffer.clear()

    def handle(self, raw: bytes, now: float) -> None:
        event = self.protocol.event(raw)
        record = self.record
        if event.text:
            if record.ttft is None:
                record.ttft = now - self.started
            else:
                record.itl.append(now - self.last)
            self.last = now
            record.text_events += 1
        if event.tokens is not None:
            record.tokens = event.tokens
            record.tokens_reported = True
        if event.prompt_tokens is not None:
            record.prompt_tokens = event.prompt_tokens
        if event.error is not None:
            record.error = event.error


async def run_request(
    connection: Connection, protocol: WireProtocol, ask: Ask, record: Record, t0: float
) -> Record:
    """Send one request on `connection` and fill `record`; never raises for HTTP failures."""
    body = protocol.encode(ask)
    headers = protocol.headers(ask) if protocol.headers else None
    started = time.perf_counter()
    record.start = started - t0
    try:
        response = await connection.request("POST", protocol.path(ask), body, headers)
        record.status = response.status
        if response.status != 200:
            record.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
            return record
        if ask.stream:
            await _read_stream(response, protocol, record, started)
        else:
            _read_whole(await response.read(), protocol, record, started, ask)
    except (HttpError, ValueError) as exc:
        record.error = str(exc)[:200]
        await connection.close()
        return record
    record.ok = record.error is None and record.ttft is not None
    if record.ok and not record.tokens_reported:
        record.tokens = record.text_events if ask.stream else ask.max_tokens
    return record


async def _read_stream(
    response: Any, protocol: WireProtocol, record: Record, started: float
) -> None:
    reader = _Reader(protocol, record, started)
    async for chunk in response.chunks():
        reader.feed(chunk, time.perf_counter())
    reader.finish(time.perf_counter())
    record.latency = reader.last - started


def _read_whole(
    body: bytes, protocol: WireProtocol, record: Record, started: float, ask: Ask
) -> None:
    now = time.perf_counter()
    event = protocol.whole(body)
    record.latency = record.ttft = now - started
    record.text_events = 1
    if event.error is not None:
        record.error = event.error
    if event.tokens is not None:
        record.tokens, record.tokens_reported = event.tokens, True
    record.prompt_tokens = event.prompt_tokens


class Progress:
    """A one-line progress bar on stderr (only on a terminal)."""

    def __init__(self, label: str, total: int, duration_s: float) -> None:
        self.label, self.total, self.duration_s = label, total, duration_s
        self.done = 0
        self.failed = 0
        self.enabled = sys.stderr.isatty()
        self._task: asyncio.Task[None] | None = None
        self._t0 = time.perf_counter()

    def add(self, record: Record) -> None:
        self.done += 1
        self.failed += not record.ok

    async def __aenter__(self) -> Progress:
        if self.enabled:
            self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._draw()
            sys.stderr.write("\n")

    async def _loop(self) -> None:
        while True:
            self._draw()
            await asyncio.sleep(0.25)

    def _draw(self) -> None:
        elapsed = time.perf_counter() - self._t0
        share = max(self.done / max(self.total, 1), min(elapsed / self.duration_s, 1.0))
        bar = "#" * int(share * 24)
        sys.stderr.write(
            f"\r  {self.label:<34} [{bar:<24}] {self.done:>5}/{self.total} "
            f"err {self.failed:<3} {elapsed:5.1f}s"
        )
        sys.stderr.flush()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def warm_up(target: Target, workload: Workload, count: int) -> None:
    """`count` requests at the window's concurrency, results discarded."""
    if count <= 0:
        return
    protocol = PROTOCOLS[workload.protocol]
    width = min(workload.concurrency or 4, count)
    connections = [Connection(target) for _ in range(width)]
    t0 = time.perf_counter()
    indexes = iter(range(count))

    async def worker(connection: Connection) -> None:
        for index in indexes:
            ask = workload.ask(index)
            await run_request(connection, protocol, ask, Record(index, ask.model), t0)

    try:
        await asyncio.gather(*(worker(c) for c in connections))
    finally:
        await asyncio.gather(*(c.close() for c in connections))


class Probe(Protocol):
    """Something sampled exactly when timing starts and stops (after the warm-up)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


async def run_window(
    target: Target, workload: Workload, label: str = "", probe: Probe | None = None
) -> Window:
    """One bounded measurement window (closed or open loop), warm-up excluded from everything."""
    await warm_up(target, workload, workload.warmup)
    connections: list[Connection] = []
    if workload.rate is None:
        # opened before timing, as a client's pool holds them: with TLS, the handshakes (one
        # per connection) stay out of both sides' CPU per request, as they do for real clients
        connections = [Connection(target) for _ in range(workload.concurrency or 1)]
        await asyncio.gather(*(c.open() for c in connections))
    if probe is not None:
        probe.start()
    cpu0, wall = _cpu_seconds(), time.time()
    async with Progress(label or workload.protocol, workload.requests, workload.duration_s) as bar:
        if workload.rate is None:
            records, duration = await _closed_loop(connections, workload, bar.add)
        else:
            records, duration = await _open_loop(target, workload, bar.add)
    client_cpu = _cpu_seconds() - cpu0
    if probe is not None:
        probe.stop()
    return Window(records, duration, client_cpu, wall)


async def _closed_loop(
    connections: list[Connection], workload: Workload, on_done: Callable[[Record], None]
) -> tuple[list[Record], float]:
    protocol = PROTOCOLS[workload.protocol]
    records: list[Record] = []
    indexes = iter(range(workload.requests))
    t0 = time.perf_counter()
    stop_at = t0 + workload.duration_s

    async def worker(connection: Connection) -> None:
        for index in indexes:
            if time.perf_counter() >= stop_at:
                return
            ask = workload.ask(index)
            record = Record(index, ask.model)
            records.append(record)
            await run_request(connection, protocol, ask, record, t0)
            on_done(record)

    tasks = [asyncio.create_task(worker(c)) for c in connections]
    await _bounded(tasks, workload.duration_s + _GRACE_S)
    await asyncio.gather(*(c.close() for c in connections))
    return records, _span(records, t0)


async def _open_loop(
    target: Target, workload: Workload, on_done: Callable[[Record], None]
) -> tuple[list[Record], float]:
    protocol = PROTOCOLS[workload.protocol]
    assert workload.rate is not None
    rng = random.Random(workload.seed)
    idle: list[Connection] = []
    cap = asyncio.Semaphore(workload.concurrency or 1_000_000)
    records: list[Record] = []
    tasks: list[asyncio.Task[None]] = []

    async def one(index: int, t0: float) -> None:
        async with cap:
            connection = idle.pop() if idle else Connection(target)
            ask = workload.ask(index)
            record = Record(index, ask.model)
            records.append(record)
            await run_request(connection, protocol, ask, record, t0)
            on_done(record)
            (idle.append(connection) if connection.keep_alive else await connection.close())

    t0 = time.perf_counter()
    due = t0
    for index in range(workload.requests):
        due += rng.expovariate(workload.rate)
        if due - t0 >= workload.duration_s:
            break
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.create_task(one(index, t0)))
    await _bounded(tasks, workload.duration_s + _GRACE_S - (time.perf_counter() - t0))
    await asyncio.gather(*(c.close() for c in idle))
    return records, _span(records, t0)


async def _bounded(tasks: list[asyncio.Task[None]], timeout: float) -> None:
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=max(timeout, 0.1))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _span(records: list[Record], t0: float) -> float:
    """From the first send to the last completion (vLLM's benchmark duration)."""
    ends = [r.start + (r.latency or 0.0) for r in records if r.latency is not None]
    for record in records:
        if record.latency is None and record.error is None:
            record.error = "cancelled at the time bound"
    return max(ends, default=time.perf_counter() - t0)
