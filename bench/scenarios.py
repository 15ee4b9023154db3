"""The scenarios of `make bench`, each a sequence of server sessions and measurement windows.

A  gateway vs vLLM's own OpenAI server, same engine flags, demo model, prompts, fixed output
   length; the arms alternate at the server level (vLLM, gateway, vLLM, gateway, ...), each
   session warm-up first and then several windows of every workload, so that restarts (~30 s
   each) do not eat the time budget. Pairs are formed window by window in that order.
B  protocol-layer ceiling: gateway on the zero-delay FakeEngine vs a bare Starlette + uvicorn
   endpoint replaying the gateway's own bytes; plain, mutual TLS, and metrics off; per protocol.
   Non-streamed and streamed requests also with wrk (a C load generator, plain HTTP), gateway
   and bare sessions alternating in each round; a streamed window's events/s = wrk's requests/s
   x the events of one response (the bare arm's capture), each window checked with one request
   and wrk's byte count. Then the batch first byte: a streamed completion with
   1, 8 and 32 prompts on the fake engine with a per-token delay.
   Server pinned to CPU 0, load generator (Python or wrk) to CPU 1.
C  multi-LoRA on the gateway: base, 1 adapter, 8 adapters (max_loras=8), 64 adapters
   (max_loras=8: LRU churn), and the cold-vs-warm cost of one adapter. Then a skewed mix (90 %
   of requests on one adapter) against few admission slots, on a gateway with fairAdmission
   and one without, alternating which starts first each round.
D  scaling on both servers: concurrency 1-64, prompt length 16-1024, and an open-loop rate sweep.
G  Triton over gRPC vs HTTP (bench/grpc_bench.py).
W  front-end workers (`ServerConfig.workers`): 1 vs 2 on the fake engine with wrk, and 2 workers
   vs vLLM's own server with `--api-server-count 2` on the real engine (bench/workers.py).
L  adapter traffic vs base traffic (base, 2, 8, 32, 128 adapters over maxLoras 2, uniform and
   Zipf mixes) on vLLM's server and the gateway with adapter-aware, fair and FIFO admission,
   with the engine's running count and adapter loads per request (bench/lora_mix.py).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import uvloop

from bench.batch import PATH as BATCH_PATH
from bench.batch import time_batches
from bench.http import BASE_HEADERS, Connection, Target
from bench.load import Workload
from bench.prompts import prompt_set
from bench.protocols import PROTOCOLS, Ask, Protocol
from bench.record import RESULTS, ProcessTreeProbe, Run
from bench.sdk import sdk_window
from bench.servers import (
    DEMO,
    EngineSettings,
    Server,
    shipped_engine,
    start_bare,
    start_gateway,
    start_shipped_gateway,
    start_vllm,
)
from bench.sources import source_windows
from bench.tools import Profiler, top_functions, vllm_bench_serve
from bench.wrk import (
    StreamCount,
    WrkResult,
    WrkTool,
    bytes_problem,
    check_problems,
    count_stream,
    ensure_wrk,
    fetch_once,
    lua_script,
    run_wrk,
    split_events,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """How much of each scenario to run (`--quick` shrinks everything for development)."""

    a_rounds: int = 3
    a_reps: int = 2
    a_requests: int = 200
    a_concurrency: int = 16
    a_prompt_len: int = 32
    a_max_tokens: int = 16
    a_warmup: int = 32
    a_shipped_rounds: int = 3  # A on the shipped config.json: rounds of (vLLM, gateway) sessions
    a_shipped_reps: int = 2
    crosscheck: bool = True
    profile: bool = True
    profile_s: float = 8.0
    gc_freeze_check: bool = True
    b_rounds: int = 3
    b_window_s: float = 1.0
    b_concurrency: int = 32
    b_stream_tokens: int = 64
    b_wrk: bool = True
    b_wrk_window_s: int = 3  # wrk counts whole seconds
    b_wrk_warmup_s: int = 1  # a separate wrk run before each window, its figures dropped
    b_wrk_stream: bool = True  # the streamed requests with wrk too
    b_wrk_stream_window_s: int = 2
    b_wrk_stream_warmup_s: int = 1
    b_arms: tuple[str, ...] | None = None  # None: B_DEFAULT_ARMS (the granian arms are opt-in)
    b_python: bool = True  # the Python client's windows and the batch first byte (off: wrk only)
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    batch_reps: int = 5
    batch_token_delay_s: float = 0.05
    batch_max_tokens: int = 4
    c_reps: int = 2
    c_requests: int = 160
    c_single: int = 24
    c_fair_rounds: int = 3
    c_fair_requests: int = 400
    c_fair_concurrency: int = 16  # in flight, against c_fair_slots admission slots: a queue
    c_fair_slots: int = 4
    d_concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    d_prompt_lens: tuple[int, ...] = (16, 64, 256, 1024)
    d_rates: tuple[float, ...] = (25.0, 50.0, 100.0, 200.0)
    d_rate_window_s: float = 3.0
    d_max_tokens: int = 32
    g_rounds: int = 3
    g_window_s: float = 6.0
    g_concurrency: int = 8
    g_max_tokens: int = 64
    g_prompt_len: int = 32
    w_rounds: int = 3  # W-B: sessions of each arm (workers 1, workers N), the first rotating
    w_workers: int = 2  # N
    w_wrk_window_s: int = 2  # W-B's non-streamed wrk windows (B's: b_wrk_window_s), for time
    w_a_rounds: int = 2  # W-A: a vLLM session, then a gateway session, each round
    w_a_reps: int = 3  # W-A: windows of each workload per session
    h_rounds: int = 3  # H: rounds of (affinity, round robin), the first arm alternating
    h_adapters: int = 16
    h_requests: int = 192
    h_concurrency: int = 8
    l_rounds: int = 3  # L: rounds of sessions of every arm, the first arm rotating
    l_rounds_in_all: int = 1  # L's rounds within `python -m bench all`
    l_requests: int = 192
    l_concurrency: int = 16
    l_max_tokens: int = 16
    l_adapters: tuple[int, ...] = (2, 8, 32, 128)  # besides the base model
    l_mixes: tuple[str, ...] = ("uniform", "zipf")
    l_arms: tuple[str, ...] | None = None  # None: lora_mix.DEFAULT_ARMS (vllm, slots, strict, fair)
    l_zipf_s: float = 1.1
    l_cycle_s: float = 2.0  # the slots arm's LoraConfig.adapterCycleTime
    l_gateway_limit: int | None = None  # the gateway arms' maxConcurrentRequests (None: 512)


QUICK = Plan(
    a_rounds=1,
    a_reps=1,
    a_requests=64,
    a_warmup=8,
    a_shipped_rounds=1,
    a_shipped_reps=1,
    crosscheck=False,
    profile_s=2.0,
    gc_freeze_check=False,
    b_rounds=1,
    b_window_s=0.5,
    b_wrk_window_s=1,
    b_wrk_stream_window_s=1,
    batch_reps=2,
    c_reps=1,
    c_requests=48,
    c_single=6,
    c_fair_rounds=1,
    c_fair_requests=160,
    d_concurrency=(1, 16, 64),
    d_prompt_lens=(16, 1024),
    d_rates=(50.0,),
    d_rate_window_s=1.0,
    g_rounds=1,
    g_window_s=2.0,
    w_rounds=1,
    w_wrk_window_s=1,
    w_a_rounds=1,
    w_a_reps=1,
    h_rounds=1,
    h_requests=48,
    l_rounds=1,
    l_requests=64,
    l_adapters=(2, 32),
)

B_PROTOCOLS = ("openai-chat", "tgi", "triton", "mindie", "djl", "anthropic")


@contextlib.contextmanager
def session(server: Server, run: Run, scenario: str, arm: str, **tags: Any) -> Iterator[Server]:
    """A server's lifetime: yield it for windows, record memory and config, always stop it."""
    try:
        yield server
        run.session(server, scenario, arm, **tags)
    finally:
        server.stop()


def start_arm(
    arm: str, name: str, run: Run, engine: EngineSettings, variant: tuple[str, ...] = ()
) -> Server:
    print(f"  starting {name} ...", flush=True)
    if arm == "vllm":
        return start_vllm(name, run.logs, engine)
    return start_gateway(name, run.logs, engine="vllm", engine_settings=engine, variant=variant)


def gc_log(run: Run, name: str) -> tuple[str, ...]:
    """The passive GC-pause log switch for a gateway session (see bench/gateway_variant.py)."""
    return ("--gc-log", str(run.logs / f"{name}.gc.jsonl"))


# -- A ---------------------------------------------------------------------------------------

A_WORKLOADS = (
    ("chat-stream", "openai-chat", True),
    ("completions", "openai-completions", False),
    ("completions-stream", "openai-completions", True),
)

# AS also through openai's own client (bench/sdk.py): what a real client costs on these 2 cores
A_SDK_WORKLOADS = (
    ("chat-stream-sdk", "openai-chat", True),
    ("completions-sdk", "openai-completions", False),
)

QUIET_CORES = 0.25  # CPU of other processes during a window above which it is repeated
TRIES = 3


def steady_window(
    run: Run,
    arm: str,
    server: Server,
    workload: Workload,
    label: str,
    scenario: str = "A",
    tree: bool = False,
    **tags: Any,
) -> dict[str, Any]:
    """An A window, repeated (up to TRIES times, the last one kept whatever happens) while
    other processes on this shared machine took QUIET_CORES or more during it. The same rule
    applies to both arms; every try is recorded (tag `attempt`). `tree`: the server's CPU by
    process role (ProcessTreeProbe: several front-end processes, scenario W)."""
    for attempt in range(TRIES):
        probe = ProcessTreeProbe(server.pid) if tree else None
        row = run.window(
            scenario, arm, server, workload, label, probe=probe, attempt=attempt, **tags
        )
        if row["others_cpu_share"] < QUIET_CORES:
            break
    return row


def rotated(items: tuple[Any, ...], shift: int) -> tuple[Any, ...]:
    """Each workload in turn runs first after a start (when the first full GC of a fresh
    process tends to land), on both arms alike."""
    shift %= len(items)
    return items[shift:] + items[:shift]


def a_workload(plan: Plan, protocol: str, stream: bool, prompts: tuple[str, ...]) -> Workload:
    """Scenario A's window for one workload (also W-A's)."""
    return Workload(
        protocol=protocol,
        stream=stream,
        max_tokens=plan.a_max_tokens,
        prompts=prompts,
        concurrency=plan.a_concurrency,
        requests=plan.a_requests,
        warmup=plan.a_warmup,
        prompt_len=plan.a_prompt_len,
    )


def scenario_a(run: Run, plan: Plan) -> None:
    engine = EngineSettings()
    run.note("engine", scenario="A", **_engine_note(engine))
    prompts = prompt_set(plan.a_prompt_len, 128, engine.model)
    last = plan.a_rounds - 1
    for rnd in range(plan.a_rounds):
        for arm in ("vllm", "gateway"):
            name = f"A-{arm}-r{rnd}"
            variant = gc_log(run, name) if arm == "gateway" else ()
            server = start_arm(arm, name, run, engine, variant)
            with session(server, run, "A", arm, round=rnd):
                for rep in range(plan.a_reps):
                    for label, protocol, stream in rotated(A_WORKLOADS, rnd + rep):
                        workload = a_workload(plan, protocol, stream, prompts)
                        steady_window(run, arm, server, workload, label, round=rnd, rep=rep)
                if rnd >= last - 1 and plan.crosscheck:
                    crosscheck(run, server, arm, engine, plan, prompts, rnd)
                if rnd == last and plan.profile:
                    profile(run, server, arm, plan, prompts)
    if plan.gc_freeze_check:
        gc_freeze_check(run, engine, plan, prompts)
    run.note("import_floor", rss_mib=import_floor())
    scenario_a_shipped(run, plan)


def scenario_a_shipped(run: Run, plan: Plan) -> None:
    """A's workloads against the gateway started from the shipped config.json as it is (mutual
    TLS: the client presents certs/client.pem and keeps its connections, as openai's httpx pool
    does) and vLLM's server on the same engine flags (plain HTTP, as it ships). Scenario "AS";
    the first arm alternates by round. Then two of them through openai's own client."""
    engine = shipped_engine()
    run.note("engine", scenario="AS", **_engine_note(engine))
    prompts = prompt_set(plan.a_prompt_len, 128, engine.model)
    for rnd in range(plan.a_shipped_rounds):
        for arm in rotated(("vllm", "gateway"), rnd):
            name = f"AS-{arm}-r{rnd}"
            print(f"  starting {name} ...", flush=True)
            server = (
                start_vllm(name, run.logs, engine)
                if arm == "vllm"
                else start_shipped_gateway(name, run.logs)
            )
            with session(server, run, "AS", arm, round=rnd):
                for rep in range(plan.a_shipped_reps):
                    for label, protocol, stream in rotated(A_WORKLOADS, rnd + rep):
                        workload = a_workload(plan, protocol, stream, prompts)
                        steady_window(
                            run, arm, server, workload, label, scenario="AS", round=rnd, rep=rep
                        )
                    for label, protocol, stream in A_SDK_WORKLOADS:
                        workload = a_workload(plan, protocol, stream, prompts)
                        sdk_window(run, "AS", arm, server, workload, label, round=rnd, rep=rep)


def gc_freeze_check(run: Run, engine: EngineSettings, plan: Plan, prompts: tuple[str, ...]) -> None:
    """Diagnostic (scenario "G", not in the ratios): the gateway with its start-up heap frozen
    (`gc.freeze()`, as vLLM's server does), same chat workload as A's first windows."""
    name = "A-gateway-gcfreeze"
    variant = ("--gc-freeze", *gc_log(run, name))
    with session(start_arm("gateway", name, run, engine, variant), run, "G", "gateway") as server:
        for rep in range(plan.a_reps + 1):
            workload = Workload(
                protocol="openai-chat",
                stream=True,
                max_tokens=plan.a_max_tokens,
                prompts=prompts,
                concurrency=plan.a_concurrency,
                requests=plan.a_requests,
                warmup=plan.a_warmup,
                prompt_len=plan.a_prompt_len,
            )
            run.window("G", "gateway", server, workload, "chat-stream-gc-freeze", rep=rep)


def import_floor() -> float | None:
    """RSS of a bare interpreter after importing vLLM's AsyncLLM: the least a front-end that
    runs the engine client in-process can weigh (both arms do)."""
    code = (
        "import re, vllm.v1.engine.async_llm\n"
        "print(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    lines = done.stdout.split()
    return int(lines[-1]) / 1024 if done.returncode == 0 and lines else None


def crosscheck(
    run: Run,
    server: Server,
    arm: str,
    engine: EngineSettings,
    plan: Plan,
    prompts: tuple[str, ...],
    rnd: int,
) -> None:
    """vLLM's serving benchmark and our OpenAI client, same target and load, back to back."""
    result = vllm_bench_serve(
        server,
        run.dir / "vllm-bench",
        f"{arm}-r{rnd}",
        model_dir=engine.model,
        served_name=engine.served_name,
        requests=plan.a_requests,
        concurrency=plan.a_concurrency,
        input_len=plan.a_prompt_len,
        output_len=plan.a_max_tokens,
    )
    ours = run.window(
        "X",
        arm,
        server,
        Workload(
            protocol="openai-completions",
            stream=True,
            max_tokens=plan.a_max_tokens,
            prompts=prompts,
            concurrency=plan.a_concurrency,
            requests=plan.a_requests,
            warmup=16,
            prompt_len=plan.a_prompt_len,
        ),
        "ours-completions-stream",
        round=rnd,
    )
    keys = (
        "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
        "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "median_e2el_ms", "completed",
        "failed", "duration", "client_cpu_share",
    )  # fmt: skip
    theirs = {k: result.get(k) for k in keys} if result else None
    mine = {**ours["summary"], "client_cpu_share": ours["client_cpu_share"]}
    run.note("crosscheck", arm=arm, round=rnd, vllm_bench=theirs, ours=mine)


def profile(run: Run, server: Server, arm: str, plan: Plan, prompts: tuple[str, ...]) -> None:
    """py-spy on the front-end process during one extra streaming-chat window (not in ratios)."""
    workload = Workload(
        protocol="openai-chat",
        stream=True,
        max_tokens=plan.a_max_tokens,
        prompts=prompts,
        concurrency=plan.a_concurrency,
        requests=100_000,
        duration_s=plan.profile_s,
        warmup=16,
        prompt_len=plan.a_prompt_len,
    )
    profiled(run, server, "A", arm, workload, "chat-stream")


def profiled(
    run: Run, server: Server, scenario: str, arm: str, workload: Workload, label: str
) -> None:
    """One extra window under py-spy (scenario "P", never used in ratios)."""
    out = run.dir / "profiles" / f"{scenario}-{arm}-{label}.collapsed.txt"
    with Profiler(server.pid, out, workload.duration_s):
        time.sleep(0.3)
        run.window("P", arm, server, workload, f"{scenario}-{label}")
    run.note(
        "profile", scenario=scenario, arm=arm, label=label, file=str(out), top=top_functions(out)
    )


def _engine_note(engine: EngineSettings) -> dict[str, Any]:
    return {
        "settings": engine.describe(),
        "vllm_argv": engine.vllm_args(),
        "gateway_config": engine.gateway_sections(),
        "env": engine.env(),
    }


# -- B ---------------------------------------------------------------------------------------

B_VARIANTS: tuple[tuple[str, dict[str, bool]], ...] = (
    ("gateway", {"tls": False, "metrics": True}),
    ("bare", {"tls": False}),
    ("gateway-tls", {"tls": True, "metrics": True}),
    ("bare-tls", {"tls": True}),
    ("gateway-nometrics", {"tls": False, "metrics": False}),
    # ServerConfig.httpRunner "granian", and the bare app on granian embedded the same way
    ("gateway-granian", {"tls": False, "metrics": True, "granian": True}),
    ("bare-granian", {"tls": False, "granian": True}),
)
B_DEFAULT_ARMS = ("gateway", "bare", "gateway-tls", "bare-tls", "gateway-nometrics")


# plain HTTP: wrk cannot present a client certificate
WRK_ARMS = ("gateway", "bare", "gateway-granian", "bare-granian")
WRK_CPU = 1
WRK_NO_TLS = (
    "plain HTTP only: wrk speaks TLS but cannot present a client certificate, and both TLS arms "
    "require one (mutual TLS)"
)


def scenario_b(run: Run, plan: Plan) -> None:
    prompts = prompt_set(32, 64, str(DEMO / "model"))
    capture = capture_file(run)
    client_cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {WRK_CPU})
    run.note("placement", scenario="B", server_cpus=[0], client_cpus=[WRK_CPU])
    try:
        arms = _b_arms(plan)
        wrk = wrk_setup(run, plan, prompts)
        for rnd in range(plan.b_rounds):
            for variant, options in arms:
                server = _start_b(variant, options, run, rnd, capture)
                with session(server, run, "B", variant, round=rnd):
                    if not capture.exists():
                        capture_bytes(server, prompts, plan, capture)
                    _b_session(run, server, variant, plan, prompts, wrk, rnd)
        if plan.batch_reps > 0 and plan.b_python:
            batch_first_byte(run, plan, prompts)
    finally:
        os.sched_setaffinity(0, client_cpus)


def _b_arms(plan: Plan) -> list[tuple[str, dict[str, bool]]]:
    """The plan's B arms in its order, with their options; the first one captures the answers
    the bare arms replay, so it is a gateway arm."""
    known = dict(B_VARIANTS)
    names = plan.b_arms or B_DEFAULT_ARMS
    unknown = [n for n in names if n not in known]
    if unknown or names[0].startswith("bare"):
        raise SystemExit(
            f"B arms {','.join(names)}: the first must be a gateway arm (it captures the bare "
            f"arms' answers) and each one of {', '.join(known)}"
        )
    return [(name, known[name]) for name in names]


def _b_session(
    run: Run,
    server: Server,
    variant: str,
    plan: Plan,
    prompts: tuple[str, ...],
    wrk: WrkSetup | None,
    rnd: int,
) -> None:
    """One B server's windows: the Python client on every protocol (whole, then streamed),
    then wrk on every protocol (plain arms; whole, then streamed), then the profiles (last
    round, gateway)."""
    for protocol in B_PROTOCOLS if plan.b_python else ():
        for stream in (False, True):
            workload = _b_workload(protocol, stream, prompts, plan)
            label = f"{protocol}-{'stream' if stream else 'whole'}"
            run.window("B", variant, server, workload, label, round=rnd)
    if wrk is not None and variant in WRK_ARMS:
        for protocol in B_PROTOCOLS:
            wrk_window(run, server, variant, protocol, wrk, plan, round=rnd)
        if plan.b_wrk_stream:
            for protocol in B_PROTOCOLS:
                wrk_window(run, server, variant, protocol, wrk, plan, stream=True, round=rnd)
    if plan.profile and plan.b_python and rnd == plan.b_rounds - 1 and variant == "gateway":
        for stream in (False, True):
            workload = replace(
                _b_workload("openai-chat", stream, prompts, plan),
                duration_s=plan.profile_s / 2,
            )
            label = f"openai-chat-{'stream' if stream else 'whole'}"
            profiled(run, server, "B", variant, workload, label)


# -- B: wrk ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WrkSetup:
    """wrk's path and version, and one script per workload (the Python client's request), keyed
    by window label: "<protocol>-whole", "<protocol>-stream"."""

    tool: WrkTool
    scripts: dict[str, Path]
    requests: dict[str, dict[str, Any]]  # label -> path, headers, body size and hash
    bodies: dict[str, bytes]  # label -> the request body (for the streamed windows' check)


def wrk_setup(
    run: Run, plan: Plan, prompts: tuple[str, ...], scenario: str = "B"
) -> WrkSetup | None:
    """Find (or install) wrk and write its scripts; None (with a note saying why) to skip."""
    if not plan.b_wrk:
        run.note("wrk", scenario=scenario, available=False, reason="switched off in the plan")
        return None
    tool = ensure_wrk()
    if tool.path is None:
        print(f"  wrk arm skipped: {tool.note}", flush=True)
        run.note("wrk", scenario=scenario, available=False, reason=tool.note)
        return None
    folder = run.dir / "wrk"
    folder.mkdir(parents=True, exist_ok=True)
    scripts: dict[str, Path] = {}
    requests: dict[str, dict[str, Any]] = {}
    bodies: dict[str, bytes] = {}
    for name in B_PROTOCOLS:
        protocol = PROTOCOLS[name]
        for stream in (False, True):
            ask = _b_workload(name, stream, prompts, plan).ask(0)  # the Python arm's request
            body = protocol.encode(ask)
            headers = {**BASE_HEADERS, **(protocol.headers(ask) if protocol.headers else {})}
            path = protocol.path(ask)
            label = f"{name}-{'stream' if stream else 'whole'}"
            scripts[label] = folder / (f"{label}.lua" if stream else f"{name}.lua")
            scripts[label].write_text(lua_script("POST", path, body, headers, totals=stream))
            bodies[label] = body
            requests[label] = {
                "path": path,
                "headers": headers,
                "body_bytes": len(body),
                "body_sha256": hashlib.sha256(body).hexdigest(),
            }
    whole = {n: requests[f"{n}-whole"] for n in B_PROTOCOLS}
    streamed = {n: requests[f"{n}-stream"] for n in B_PROTOCOLS}
    run.note(
        "wrk", scenario=scenario, available=True, path=tool.path, version=tool.version,
        how=tool.note, requests=whole, stream_requests=streamed, tls=WRK_NO_TLS, cpu=WRK_CPU,
    )  # fmt: skip
    return WrkSetup(tool, scripts, requests, bodies)


def wrk_window(
    run: Run,
    server: Server,
    arm: str,
    protocol: str,
    wrk: WrkSetup,
    plan: Plan,
    *,
    stream: bool = False,
    scenario: str = "W",
    **tags: Any,
) -> dict[str, Any]:
    """One wrk window (after a warm-up run whose figures are dropped), recorded as `scenario`
    ("W": scenario B's wrk windows); a run with non-2xx responses, socket errors or an
    unreadable report is `flagged`. A streamed window also gets events/s (requests/s x the
    events of one response in the bare arm's capture) and is flagged when one checked response
    or wrk's byte count disagree. The server's CPU is read by process role (ProcessTreeProbe:
    with one process, as before, all of it is the front end's)."""
    assert wrk.tool.path is not None
    label = f"{protocol}-{'stream' if stream else 'whole'}"
    request = wrk.requests[label]
    url = server.url + request["path"]
    script = wrk.scripts[label]
    window_s = plan.b_wrk_stream_window_s if stream else plan.b_wrk_window_s
    warmup_s = plan.b_wrk_stream_warmup_s if stream else plan.b_wrk_warmup_s
    options: dict[str, Any] = {"connections": plan.b_concurrency, "threads": 1, "cpu": WRK_CPU}
    warm = None
    if warmup_s > 0:
        warm = run_wrk(wrk.tool.path, url, script, duration_s=warmup_s, **options)
    probe = ProcessTreeProbe(server.pid)
    probe.start()
    done = run_wrk(wrk.tool.path, url, script, duration_s=window_s, **options)
    probe.stop()
    result = done.result
    log = run.dir / "wrk" / f"{server.name}-{protocol}{'-stream' if stream else ''}.txt"
    log.write_text(" ".join(done.argv) + "\n" + done.output)
    streamed: dict[str, Any] = {}
    if stream:
        streamed = _stream_check(server, protocol, label, wrk, capture_file(run), result, plan)
    summary = {
        **result.summary(),
        "completed": result.requests,
        "failed": result.errors,
        "warmup_flagged": warm.result.flagged if warm is not None else None,
        **streamed,
    }
    settings = {
        "tool": "wrk",
        "wrk_version": wrk.tool.version,
        "protocol": protocol,
        "stream": stream,
        "max_tokens": plan.b_stream_tokens if stream else 16,
        "concurrency": plan.b_concurrency,
        "threads": 1,
        "duration_s": window_s,
        "warmup_s": warmup_s,
        "mode": "closed",
        "argv": done.argv,
        **request,
    }
    if stream:
        settings["events_per_response"] = streamed["events_per_response"]
        settings["events_source"] = STREAM_EVENTS_SOURCE
    row = run.tool_window(
        scenario, arm, server, label, settings=settings, summary=summary, probe=probe,
        duration_s=done.wall_s, client_cpu_s=done.cpu_s, wall_start=done.wall_start, **tags,
    )  # fmt: skip
    latency = result.latency_ms
    flag = "  FLAGGED: " + _wrk_problems(result) if result.flagged else ""
    events = f" {summary['events_per_s'] or 0.0:9.0f} ev/s" if stream else ""
    print(
        f"  {scenario} {arm:<8} {label:<24} {result.requests:>6} req "
        f"{result.req_per_s or 0.0:8.1f} req/s{events}  p50 {latency.get('p50', 0.0):6.2f} ms "
        f"p99 {latency.get('p99', 0.0):6.2f} ms  cpu wrk {row['client_cpu_share']:.2f} "
        f"server {row['server_cpu_share']:.2f}{flag}",
        flush=True,
    )
    return row


STREAM_EVENTS_SOURCE = (
    "token events of one streamed response as the bare arm replays it (its capture), read as "
    "the Python client reads them"
)


def capture_file(run: Run) -> Path:
    """The gateway's captured answers that the bare arm replays (written in the first session)."""
    return run.dir / "b-capture.json"


def captured_stream(capture: Path, protocol: Protocol, path: str) -> StreamCount:
    """The events of the streamed answer the bare arm replays for `path`."""
    entry = json.loads(capture.read_text())[path]["stream"]
    return count_stream(protocol, b"".join(base64.b64decode(e) for e in entry["events"]))


def _stream_check(
    server: Server,
    protocol: str,
    label: str,
    wrk: WrkSetup,
    capture: Path,
    result: WrkResult,
    plan: Plan,
) -> dict[str, Any]:
    """A streamed wrk window's events/s and its checks, adding any problem to `result` (which
    flags the window): one request of our own after the window (the same bytes as wrk's; its
    token events and events must match the capture's), and wrk's exact byte count (whole
    responses of that size; a cut-off stream reads fewer bytes)."""
    wire = PROTOCOLS[protocol]
    request = wrk.requests[label]
    expected = captured_stream(capture, wire, request["path"])
    check: dict[str, Any]
    try:
        response = fetch_once(
            server.url, "POST", request["path"], wrk.bodies[label], request["headers"]
        )
    except (OSError, ValueError) as exc:
        result.problems.append(f"check request failed: {exc!r}"[:200])
        check = {"ok": False, "error": repr(exc)[:200]}
    else:
        found = count_stream(wire, response.body)
        problems = check_problems(response.status, found, expected)
        check = {
            "ok": not problems, "status": response.status, **asdict(found),
            "wire_bytes": response.wire_bytes, "chunks": response.chunks,
        }  # fmt: skip
        result.problems += problems
        if response.status == 200 and (
            problem := bytes_problem(
                result.bytes_read, result.requests, plan.b_concurrency, response.wire_bytes
            )
        ):
            result.problems.append(problem)
    per_response = expected.text_events
    return {
        "events_per_response": per_response,
        "chunks_per_response": expected.events,
        "events_per_s": None if result.req_per_s is None else result.req_per_s * per_response,
        "bytes_per_response": result.bytes_read / result.requests
        if result.bytes_read is not None and result.requests
        else None,
        "check": check,
    }


def _wrk_problems(result: WrkResult) -> str:
    parts = [f"{result.non_2xx} non-2xx"] if result.non_2xx else []
    parts += [f"{v} socket {k}" for k, v in result.socket_errors.items() if v]
    return ", ".join(parts + result.problems) or "no figures"


# -- B: batch first byte ----------------------------------------------------------------------


def batch_first_byte(run: Run, plan: Plan, prompts: tuple[str, ...]) -> None:
    """Streamed `/v1/completions` with 1, 8 and 32 prompts on the fake engine with a per-token
    delay: time to the first byte, the first token event and the first token of every prompt
    (bench/batch.py). One note per request (kind "batch_first_byte")."""
    delay = plan.batch_token_delay_s
    overrides = {"ModelConfig": {"engineOptions": {"token_delay_s": delay}}}
    name = "B-gateway-batch"
    print(f"  starting {name} ...", flush=True)
    server = start_gateway(name, run.logs, engine="fake", overrides=overrides, cpus={0})
    settings = {
        "token_delay_s": delay,
        "max_tokens": plan.batch_max_tokens,
        "sizes": list(plan.batch_sizes),
        "reps": plan.batch_reps,
        "prompt_len": 32,
        "path": BATCH_PATH,
    }
    run.note("batch_settings", scenario="B", **settings)
    with session(server, run, "B", "gateway-batch"):
        timings = uvloop.run(
            time_batches(
                Target.parse(server.url, server.tls),
                prompts,
                plan.batch_sizes,
                reps=plan.batch_reps,
                max_tokens=plan.batch_max_tokens,
            )
        )
        for rep, timing in timings:
            row = timing.row()
            run.note("batch_first_byte", scenario="B", rep=rep, token_delay_s=delay, **row)
            print(
                f"  batch {timing.prompts:>3} prompts: first byte {_ms(timing.first_byte_s)} "
                f"first event {_ms(timing.first_event_s)} all started "
                f"{_ms(timing.all_started_s)} total {_ms(timing.total_s)}"
                + ("" if timing.ok else f"  FLAGGED: {timing.error or row['token_events']}"),
                flush=True,
            )


def _ms(seconds: float | None) -> str:
    return "     –   " if seconds is None else f"{seconds * 1000:7.1f} ms"


def _start_b(variant: str, options: dict[str, bool], run: Run, rnd: int, capture: Path) -> Server:
    name = f"B-{variant}-r{rnd}"
    tls, granian = options["tls"], options.get("granian", False)
    if variant.startswith("bare"):
        return start_bare(name, run.logs, capture, tls=tls, cpus={0}, granian=granian)
    switches = () if options["metrics"] else ("--no-metrics",)
    runner = {"ServerConfig": {"httpRunner": "granian"}} if granian else {}
    return start_gateway(
        name, run.logs, engine="fake", tls=tls, variant=switches, cpus={0}, overrides=runner
    )


def _b_workload(protocol: str, stream: bool, prompts: tuple[str, ...], plan: Plan) -> Workload:
    return Workload(
        protocol=protocol,
        stream=stream,
        max_tokens=plan.b_stream_tokens if stream else 16,
        prompts=prompts[:1],  # the bare arm replays one captured answer; same request here
        concurrency=plan.b_concurrency,
        requests=10_000_000,
        duration_s=plan.b_window_s,
        warmup=64,
        prompt_len=32,
    )


def capture_bytes(server: Server, prompts: tuple[str, ...], plan: Plan, out: Path) -> None:
    """The gateway's exact answers (status 200) for every B request, for the bare arm."""

    async def grab() -> dict[str, dict[str, dict[str, Any]]]:
        connection = Connection(Target.parse(server.url, server.tls))
        captured: dict[str, dict[str, dict[str, Any]]] = {}
        for name in B_PROTOCOLS:
            protocol = PROTOCOLS[name]
            for stream in (False, True):
                workload = _b_workload(name, stream, prompts, plan)
                ask: Ask = workload.ask(0)
                response = await connection.request(
                    "POST", protocol.path(ask), protocol.encode(ask)
                )
                body = await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{name} answered {response.status}: {body[:200]!r}")
                entry: dict[str, Any] = {"content_type": response.headers.get("content-type", "")}
                if stream:
                    events = split_events(body, protocol.delimiter)
                    entry["events"] = [base64.b64encode(e).decode() for e in events]
                else:
                    entry["body"] = base64.b64encode(body).decode()
                captured.setdefault(protocol.path(ask), {})["stream" if stream else "whole"] = entry
        await connection.close()
        return captured

    out.write_text(json.dumps(uvloop.run(grab()), indent=1))


# -- C ---------------------------------------------------------------------------------------


def lora_copies(count: int, source: Path, folder: Path, prefix: str = "c") -> list[str]:
    """`count` adapters named c00.. (copies of the demo adapter a1: same size, own identity:
    each config carries its name as `revision`, so each has its own content digest and its own
    engine place; identical files would share one)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"{prefix}{i:02d}" for i in range(count)]
    for name in names:
        target = folder / name
        if not target.exists():
            shutil.copytree(source, target)
            config_path = target / "adapter_config.json"
            config = json.loads(config_path.read_text())
            config["revision"] = name
            config_path.write_text(json.dumps(config, indent=2))
    return names


def scenario_c(run: Run, plan: Plan) -> None:
    folder = RESULTS / "adapters-c"
    for dropped in folder.glob(f"{FIRST_PREFIX}*"):  # dropped in after the start, every run
        shutil.rmtree(dropped)
    names = lora_copies(64, DEMO / "adapters" / "a1", folder)
    engine = EngineSettings(max_loras=8, max_cpu_loras=8, adapter_dir=str(folder))
    run.note("engine", scenario="C", **_engine_note(engine))
    prompts = prompt_set(32, 128, engine.model)
    mixes = (
        ("base", ("tiny",)),
        ("1-adapter", tuple(names[:1])),
        ("8-adapters", tuple(names[:8])),
        ("64-adapters", tuple(names)),
    )
    server = start_arm("gateway", "C-gateway", run, engine, gc_log(run, "C-gateway"))
    with session(server, run, "C", "gateway"):
        for rep in range(plan.c_reps):
            for label, models in mixes:
                workload = Workload(
                    protocol="openai-completions",
                    stream=True,
                    max_tokens=16,
                    prompts=prompts,
                    models=models,
                    concurrency=16,
                    requests=plan.c_requests,
                    warmup=16 if label != "64-adapters" else 0,
                    prompt_len=32,
                )
                run.window("C", "gateway", server, workload, label, rep=rep)
        cold_and_warm(run, server, names, prompts, plan)
        first_requests(run, server, folder, prompts, plan)
        registration_cost(run, server, folder)
    churn_on_demand(run, plan, prompts)
    s3_folder = RESULTS / "adapters-c-s3"
    copies = lora_copies(plan.c_single, DEMO / "adapters" / "a1", s3_folder, "s")
    source_windows(run, replace(engine, max_loras=2, max_cpu_loras=4), prompts, plan.c_single,
                   copies, s3_folder)
    skewed_mix(run, plan, engine, names, prompts)


FIRST_PREFIX = "f"


def first_requests(
    run: Run, server: Server, folder: Path, prompts: tuple[str, ...], plan: Plan
) -> None:
    """Adapters dropped into the served adapterDir after the start, one request each, one at a
    time: each first request registers, validates, digests and loads its adapter."""
    names = lora_copies(plan.c_single, DEMO / "adapters" / "a1", folder, FIRST_PREFIX)
    workload = _c_single(prompts, tuple(names), plan.c_single)
    run.window("C", "gateway", server, workload, "single-first-request")


def churn_on_demand(run: Run, plan: Plan, prompts: tuple[str, ...]) -> None:
    """64 adapters dropped into an empty adapterDir after the start, through `max_loras=2`
    (4 cached places): every one is registered by its first request, then churned."""
    folder = RESULTS / "adapters-c-churn"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    engine = EngineSettings(max_loras=2, max_cpu_loras=4, adapter_dir=str(folder))
    server = start_arm("gateway", "C-churn", run, engine)
    with session(server, run, "C", "gateway-churn"):
        names = lora_copies(64, DEMO / "adapters" / "a1", folder, "o")
        workload = Workload(
            protocol="openai-completions", stream=True, max_tokens=16, prompts=prompts,
            models=tuple(names), concurrency=16, requests=plan.c_requests, prompt_len=32,
        )
        run.window("C", "gateway-churn", server, workload, "64-on-demand-max-loras-2")


def cold_and_warm(
    run: Run, server: Server, names: list[str], prompts: tuple[str, ...], plan: Plan
) -> None:
    """One request at a time: base; one adapter again and again (warm, after 4 to settle);
    then each of `c_single` adapters once, none among the 8 most recently used (cold)."""
    single = _c_single(prompts, ("tiny",), plan.c_single)
    run.window("C", "gateway", server, single, "single-base")
    warm = _c_single(prompts, (names[0],), plan.c_single + 4)
    run.window("C", "gateway", server, warm, "single-warm-adapter")
    cold = _c_single(prompts, tuple(names[10 : 10 + plan.c_single]), plan.c_single)
    run.window("C", "gateway", server, cold, "single-cold-adapter")


def _c_single(prompts: tuple[str, ...], models: tuple[str, ...], count: int) -> Workload:
    return Workload(
        protocol="openai-completions",
        stream=True,
        max_tokens=16,
        prompts=prompts,
        models=models,
        concurrency=1,
        requests=count,
        prompt_len=32,
    )


def registration_cost(run: Run, server: Server, folder: Path) -> None:
    """DJL's register call (`preload=true`: validated and loaded) for fresh adapters, timed."""
    names = lora_copies(5, DEMO / "adapters" / "a1", folder.parent / "adapters-c-new", "n")
    timings: list[float] = []
    errors: list[str] = []
    with httpx.Client(base_url=server.management_url or server.url, timeout=60) as client:
        for name in names:
            src = str(folder.parent / "adapters-c-new" / name)
            t0 = time.perf_counter()
            response = client.post(
                "/models/tiny/adapters", params={"name": name, "src": src, "preload": "true"}
            )
            elapsed = time.perf_counter() - t0
            if response.status_code == 200:
                timings.append(elapsed * 1000)
            else:
                errors.append(f"{response.status_code} {response.text[:120]}")
    run.note("registration", scenario="C", ms=timings, errors=errors)


FAIR_ARMS = ("fair", "fifo")
HOT_PER_COLD = 9  # 90 % of requests on the hot adapter


def skewed_models(hot: str, cold: tuple[str, ...]) -> tuple[str, ...]:
    """The request mix, assigned round-robin: nine requests on `hot`, then one on the next cold
    adapter, so the cold requests are spread evenly through the window."""
    return tuple(m for c in cold for m in (*(hot,) * HOT_PER_COLD, c))


def skewed_mix(
    run: Run, plan: Plan, engine: EngineSettings, names: list[str], prompts: tuple[str, ...]
) -> None:
    """The fairness effect: a skewed mix (one hot adapter, three cold ones) at more requests in
    flight than admission slots, so a queue forms, on a gateway with `fairAdmission` (the
    queue serves adapters in turn) and one without (one FIFO), alternating which arm starts
    first each round; one server at a time, restarted per session."""
    models = skewed_models(names[0], tuple(names[1:4]))
    workload = Workload(
        protocol="openai-completions",
        stream=True,
        max_tokens=16,
        prompts=prompts,
        models=models,
        concurrency=plan.c_fair_concurrency,
        requests=plan.c_fair_requests,
        warmup=len(models),  # every adapter of the mix loaded before timing
        prompt_len=32,
    )
    for rnd in range(plan.c_fair_rounds):
        for position, arm in enumerate(rotated(FAIR_ARMS, rnd)):
            name = f"C-{arm}-r{rnd}"
            limits = {"maxConcurrentRequests": plan.c_fair_slots, "fairAdmission": arm == "fair"}
            print(f"  starting {name} ...", flush=True)
            server = start_gateway(
                name, run.logs, engine_settings=engine, overrides={"LimitsConfig": limits}
            )
            with session(server, run, "C", arm, round=rnd):
                run.window(
                    "C", arm, server, workload, "skewed-mix",
                    round=rnd, first=position == 0, slots=plan.c_fair_slots,
                )  # fmt: skip


# -- D ---------------------------------------------------------------------------------------


def scenario_d(run: Run, plan: Plan) -> None:
    longest = max(plan.d_prompt_lens) + plan.d_max_tokens
    context = 512 if longest <= 512 else 2048
    engine = EngineSettings(max_model_len=context, allow_long_context=context > 512)
    run.note("engine", scenario="D", **_engine_note(engine))
    prompt_sets = {n: prompt_set(n, 64, engine.model, seed=n) for n in (64, *plan.d_prompt_lens)}
    for arm in ("vllm", "gateway"):
        name = f"D-{arm}"
        variant = gc_log(run, name) if arm == "gateway" else ()
        with session(start_arm(arm, name, run, engine, variant), run, "D", arm) as server:
            for concurrency in plan.d_concurrency:
                workload = _d_workload(prompt_sets[64], plan, concurrency=concurrency)
                requests = min(max(32, 8 * concurrency), 512)
                workload = replace(workload, requests=requests, prompt_len=64)
                run.window("D", arm, server, workload, f"concurrency-{concurrency}")
            for length in plan.d_prompt_lens:
                workload = replace(
                    _d_workload(prompt_sets[length], plan, concurrency=16), prompt_len=length
                )
                run.window("D", arm, server, workload, f"prompt-{length}")
            for rate in plan.d_rates:
                workload = replace(
                    _d_workload(prompt_sets[64], plan, concurrency=256),
                    rate=rate,
                    requests=int(rate * plan.d_rate_window_s),
                    duration_s=plan.d_rate_window_s + 30,
                    prompt_len=64,
                )
                run.window("D", arm, server, workload, f"rate-{rate:g}")


def _d_workload(prompts: tuple[str, ...], plan: Plan, *, concurrency: int) -> Workload:
    return Workload(
        protocol="openai-completions",
        stream=True,
        max_tokens=plan.d_max_tokens,
        prompts=prompts,
        concurrency=concurrency,
        requests=128,
        duration_s=30.0,
        warmup=min(concurrency, 16),
    )


def scenario_g(run: Run, plan: Plan) -> None:
    """gRPC ModelStreamInfer vs HTTP generate_stream, then perf_analyzer (bench/grpc_bench.py)."""
    from bench.grpc_bench import run_g

    run_g(run, plan)


def scenario_w(run: Run, plan: Plan) -> None:
    """Front-end workers: `ServerConfig.workers` 1 vs N on the fake engine with wrk, and N
    workers vs vLLM's `--api-server-count N` on the real engine (bench/workers.py)."""
    from bench.workers import run_w

    run_w(run, plan)


def scenario_h(run: Run, plan: Plan) -> None:
    """Adapter affinity at a real HAProxy: hash on the adapter vs round robin, two replicas on
    the real engine (bench/affinity.py). Run on request, not by `all`."""
    from bench.affinity import run_h

    run_h(run, plan)


def scenario_l(run: Run, plan: Plan) -> None:
    """Adapter traffic vs base traffic, the gateway's admission arms and vLLM's server
    (bench/lora_mix.py)."""
    from bench.lora_mix import run_l

    run_l(run, plan)


SCENARIOS = {
    "a": scenario_a, "as": scenario_a_shipped, "b": scenario_b, "c": scenario_c,
    "d": scenario_d, "g": scenario_g, "w": scenario_w, "h": scenario_h, "l": scenario_l,
}
ALL = ("a", "b", "c", "d", "g", "w", "l")  # `python -m bench all`: H runs on request only
