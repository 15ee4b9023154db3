"""Scenario AS's windows through openai's own Python client (`AsyncOpenAI` over its httpx pool),
next to the lean load generator's: what a user's client costs, and what it does to the ratio.

The SDK spends several times the front-end's CPU per streamed request (an httpx stream, an SSE
decoder, a pydantic model per chunk); on this 2-core box, shared by client, front-end and engine,
that is what an outside check with a real client measures. Closed loop, one connection per
concurrent request kept open across requests (httpx's pool, the SDK's limits), mutual TLS with
the server's client context when it has one.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import uvloop

from bench.load import Record, Workload, _cpu_seconds
from bench.record import CpuProbe, Run
from bench.servers import Server, descendants
from bench.stats import summarize

CLIENT = "openai SDK"


async def _one(client: Any, workload: Workload, index: int, t0: float) -> Record:
    ask = workload.ask(index)
    record = Record(index=index, model=ask.model)
    started = last = time.perf_counter()
    record.start = started - t0
    options: dict[str, Any] = {
        "model": ask.model, "max_tokens": ask.max_tokens, "stream": ask.stream,
        "extra_body": {"ignore_eos": ask.ignore_eos},
    }  # fmt: skip
    try:
        if workload.protocol == "openai-chat":
            messages = [{"role": "user", "content": ask.prompt}]
            answer = await client.chat.completions.create(messages=messages, **options)
        else:
            answer = await client.completions.create(prompt=ask.prompt, **options)
        if ask.stream:
            async for _chunk in answer:
                now = time.perf_counter()
                if record.ttft is None:
                    record.ttft = now - started
                else:
                    record.itl.append(now - last)
                last = now
                record.text_events += 1
        else:
            record.ttft = time.perf_counter() - started
            record.text_events = 1
    except Exception as exc:  # the SDK's errors: recorded as a failed request
        record.error = f"{type(exc).__name__}: {exc}"[:200]
        return record
    record.latency = time.perf_counter() - started
    record.ok = record.ttft is not None
    record.tokens = ask.max_tokens  # ignore_eos: every request runs to max_tokens
    return record


async def _loop(
    server: Server, workload: Workload, probe: CpuProbe
) -> tuple[list[Record], float, float]:
    """The warm-up requests, then the timed ones: their records, seconds and client CPU."""
    import openai

    verify: Any = server.tls if server.tls is not None else True
    # the SDK's own pool (its limits: 100 idle connections kept), with the client certificate
    async with openai.DefaultAsyncHttpxClient(verify=verify) as http:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="bench", http_client=http, max_retries=0
        )
        concurrency = workload.concurrency or 1
        for phase, count in (("warm-up", workload.warmup), ("timed", workload.requests)):
            counter = itertools.count()
            records: list[Record] = []
            t0 = time.perf_counter()

            async def worker(
                limit: int, t0: float = t0, records: list[Record] = records, counter: Any = counter
            ) -> None:
                while (index := next(counter)) < limit:
                    records.append(await _one(client, workload, index, t0))

            if phase == "timed":
                probe.start()
                cpu0 = _cpu_seconds()
            await asyncio.gather(*(worker(count) for _ in range(concurrency)))
        duration = time.perf_counter() - t0
        client_cpu = _cpu_seconds() - cpu0
        probe.stop()
    return records, duration, client_cpu


def sdk_window(
    run: Run, scenario: str, arm: str, server: Server, workload: Workload, label: str, **tags: Any
) -> dict[str, Any]:
    """One window of `workload` through the openai SDK, recorded as `label` (with per-request
    figures in the summary, as the lean client's windows)."""
    probe = CpuProbe(server.pid, descendants(server.pid))
    wall = time.time()
    records, duration, client_cpu = uvloop.run(_loop(server, workload, probe))
    summary = summarize(records, duration)
    row = run.tool_window(
        scenario, arm, server, label, settings={**workload.settings(), "client": CLIENT},
        summary=summary, probe=probe, duration_s=duration, client_cpu_s=client_cpu,
        wall_start=wall, **tags,
    )  # fmt: skip
    print(
        f"  {scenario} {arm:8} {label:28} {summary['completed']:4} ok {summary['failed']:3} err "
        f"{summary['req_per_s']:8.1f} req/s  cpu client {row['client_cpu_share']:.2f} "
        f"server {row['server_cpu_share']:.2f}",
        flush=True,
    )
    return row
