"""Scenario W: the gateway's front-end workers (`ServerConfig.workers`: a supervisor binds the
listeners, N worker processes serve them, each its own client of one engine core).

W-B  The gateway on the fake engine (each worker runs its own; no engine core) with workers 1
     and workers N, driven by wrk on scenario B's requests (the same Lua scripts: non-streamed
     OpenAI chat and TGI, streamed OpenAI chat; non-streamed windows of `w_wrk_window_s`, 2 s
     against B's 3, for the time budget), sessions alternating with the first arm rotating each
     round. The gateway is not pinned (scenario B pins its one process to CPU 0:
     N workers pinned to one core would measure nothing), wrk and this process are pinned to
     CPU 1 as in B, so on 2 cores the N workers share CPU 1 with wrk. Every window records the
     CPU of each process of the gateway (supervisor + workers) and of the whole machine.
W-A  The gateway with workers N on the real vLLM engine vs vLLM's own server with
     `--api-server-count N` (`vllm serve`'s multi-API-server launch, bench/vllm_serve.py), same
     engine flags (scenario A's `EngineSettings`, adapters given at start on both arms) and
     the same environment minus VLLM_ALLOW_RUNTIME_LORA_UPDATING, which vLLM refuses with more
     than one API server. Scenario A's streaming-chat and non-streaming completions windows
     (Python load generator, A's rule of repeating a window other processes disturbed), one
     server at a time: each round a vLLM session, then a gateway session.

Recorded as scenarios "WB" and "WA" in windows.jsonl ("W" is scenario B's wrk windows).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from bench.prompts import prompt_set
from bench.record import Run
from bench.scenarios import (
    A_WORKLOADS,
    WRK_CPU,
    Plan,
    _engine_note,
    a_workload,
    capture_bytes,
    capture_file,
    rotated,
    session,
    steady_window,
    wrk_setup,
    wrk_window,
)
from bench.servers import DEMO, EngineSettings, Server, start_gateway, start_vllm, vllm_command

WB_WHOLE = ("openai-chat", "tgi")  # non-streamed requests/s
WB_STREAM = ("openai-chat",)  # streamed events/s
WA_LABELS = ("chat-stream", "completions")
PLACEMENT = (
    "gateway processes not pinned (all cores: pinning N workers to scenario B's one server "
    "core would put them on one core); wrk (1 thread) and the harness pinned to CPU 1 as in B"
)


def run_w(run: Run, plan: Plan) -> None:
    w_b(run, plan)
    w_a(run, plan)


def arm_name(workers: int) -> str:
    return f"workers{workers}"


def w_b(run: Run, plan: Plan) -> None:
    prompts = prompt_set(32, 64, str(DEMO / "model"))
    plan = replace(plan, b_wrk_window_s=plan.w_wrk_window_s)  # the rest as in B
    wrk = wrk_setup(run, plan, prompts, scenario="WB")
    if wrk is None:
        print("  W-B skipped: no wrk", flush=True)
        return
    capture = capture_file(run)  # scenario B's, when B ran first in this run
    every_cpu = os.sched_getaffinity(0)
    run.note(
        "placement", scenario="WB", server_cpus=sorted(every_cpu), client_cpus=[WRK_CPU],
        wrk_threads=1, wrk_connections=plan.b_concurrency, why=PLACEMENT,
    )  # fmt: skip
    os.sched_setaffinity(0, {WRK_CPU})
    try:
        for rnd in range(plan.w_rounds):
            for workers in rotated((1, plan.w_workers), rnd):
                arm = arm_name(workers)
                name = f"WB-{arm}-r{rnd}"
                print(f"  starting {name} ...", flush=True)
                server = start_gateway(
                    name, run.logs, engine="fake", cpus=every_cpu,
                    overrides={"ServerConfig": {"workers": workers}},
                )  # fmt: skip
                with session(server, run, "WB", arm, round=rnd, workers=workers):
                    if not capture.exists():
                        capture_bytes(server, prompts, plan, capture)
                    for protocol in WB_WHOLE:
                        wrk_window(run, server, arm, protocol, wrk, plan, scenario="WB", round=rnd)
                    for protocol in WB_STREAM:
                        wrk_window(
                            run, server, arm, protocol, wrk, plan,
                            stream=True, scenario="WB", round=rnd,
                        )  # fmt: skip
    finally:
        os.sched_setaffinity(0, every_cpu)


def w_a(run: Run, plan: Plan) -> None:
    engine = EngineSettings()
    count = plan.w_workers
    env = engine.env(runtime_lora_updates=False)
    run.note(
        "engine", scenario="WA", **{**_engine_note(engine), "env": env},
        api_servers=count, vllm_command=vllm_command(engine, 0, count)[1:],
        gateway_overrides={"ServerConfig": {"workers": count}},
    )  # fmt: skip
    prompts = prompt_set(plan.a_prompt_len, 128, engine.model)
    workloads = tuple(w for w in A_WORKLOADS if w[0] in WA_LABELS)
    for rnd in range(plan.w_a_rounds):
        for arm in ("vllm", "gateway"):
            name = f"WA-{arm}-r{rnd}"
            print(f"  starting {name} ...", flush=True)
            server = _start_wa(arm, name, run, engine, count, env)
            with session(server, run, "WA", arm, round=rnd, workers=count):
                for rep in range(plan.w_a_reps):
                    for label, protocol, stream in rotated(workloads, rnd + rep):
                        workload = a_workload(plan, protocol, stream, prompts)
                        steady_window(
                            run, arm, server, workload, label,
                            scenario="WA", tree=True, round=rnd, rep=rep,
                        )  # fmt: skip


def _start_wa(
    arm: str, name: str, run: Run, engine: EngineSettings, count: int, env: dict[str, str]
) -> Server:
    if arm == "vllm":
        return start_vllm(name, run.logs, engine, api_servers=count, env=env)
    overrides: dict[str, Any] = {"ServerConfig": {"workers": count}}
    return start_gateway(name, run.logs, engine_settings=engine, overrides=overrides, env=env)


