"""Scenario G: Triton's gRPC `ModelStreamInfer` against HTTP `generate_stream`, on one gateway
and the real engine, then NVIDIA's own Triton benchmark client against the gRPC listener.

- Both arms stream the same Triton requests (vLLM backend inputs: `text_input`, `stream: true`,
  `sampling_parameters` with `max_tokens` and `ignore_eos`) at the same concurrency, closed loop,
  alternating which arm goes first each round; the report gives the median of the per-round
  gRPC/HTTP ratios (requests/s, output tokens/s, TTFT).
- The HTTP arm is the bench's own load generator (protocol `triton`). The gRPC arm is this
  module's: `concurrency` workers, each on its own stream (as a tritonclient user holds one),
  one request at a time, timing the first response and the final one.
- perf_analyzer ships in the tritonclient wheel. It needs libb64 (Debian `libb64-0d`, installed
  with apt-get as wrk is) and loads libcudart even on a CPU host (the pip wheel
  `nvidia-cuda-runtime-cu12` provides it; nothing else of CUDA is used). Where either cannot be
  had, the window is skipped with the reason recorded.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import uvloop
from tritonclient.grpc import service_pb2, service_pb2_grpc

from bench.load import Record, Workload
from bench.record import CpuProbe, Run
from bench.servers import DEMO, EngineSettings, Server, descendants, free_port, start_gateway
from bench.stats import summarize
from bench.wrk import _apt_install

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "build" / "tools"
PERF_ANALYZER = Path(sys.executable).parent / "perf_analyzer"
CUDART_WHEEL = "nvidia-cuda-runtime-cu12"
FINAL = "triton_final_response"


def _bytes_tensor(value: bytes) -> bytes:
    return struct.pack("<I", len(value)) + value


def stream_request(prompt: str, max_tokens: int, model: str, request_id: str) -> Any:
    """The vLLM backend's streamed request, as tritonclient builds it (raw contents)."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    sampling = json.dumps({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    for name, datatype, raw in (
        ("text_input", "BYTES", _bytes_tensor(prompt.encode())),
        ("stream", "BOOL", b"\x01"),
        ("sampling_parameters", "BYTES", _bytes_tensor(sampling.encode())),
        ("exclude_input_in_output", "BOOL", b"\x01"),
    ):
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        request.raw_input_contents.append(raw)
    return request


@dataclass(slots=True)
class _Worker:
    """One stream, one request at a time: the next goes out when the last one's final
    response arrived."""

    stub: Any
    workload: Workload
    records: list[Record]
    t0: float
    deadline: float

    async def run(self, first_index: int, step: int) -> None:
        outgoing: asyncio.Queue[Any] = asyncio.Queue()

        async def requests() -> Any:
            while (item := await outgoing.get()) is not None:
                yield item

        call = self.stub.ModelStreamInfer(requests())
        index = first_index
        try:
            while time.perf_counter() < self.deadline:
                await self._one(call, outgoing, index)
                index += step
        finally:
            await outgoing.put(None)
            call.cancel()

    async def _one(self, call: Any, outgoing: asyncio.Queue[Any], index: int) -> None:
        ask = self.workload.ask(index)
        record = Record(index=index, model=ask.model, start=time.perf_counter() - self.t0)
        started = time.perf_counter()
        await outgoing.put(stream_request(ask.prompt, ask.max_tokens, ask.model, str(index)))
        last = started
        while True:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                record.error = "stream ended"
                break
            now = time.perf_counter()
            if reply.error_message:
                record.error = reply.error_message
                break
            record.text_events += 1
            record.tokens += 1
            if record.ttft is None:
                record.ttft = now - started
            else:
                record.itl.append(now - last)
            last = now
            if reply.infer_response.parameters[FINAL].bool_param:
                record.ok, record.latency, record.status = True, now - started, 200
                break
        self.records.append(record)


async def grpc_window(
    address: str, workload: Workload, probe: CpuProbe
) -> tuple[list[Record], float, float]:
    """(records, duration, client CPU seconds) of one closed-loop window."""
    concurrency = workload.concurrency or 1
    async with grpc.aio.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        await _warm(stub, workload)
        records: list[Record] = []
        cpu0 = time.process_time()
        probe.start()
        t0 = time.perf_counter()
        deadline = t0 + workload.duration_s
        workers = [_Worker(stub, workload, records, t0, deadline) for _ in range(concurrency)]
        await asyncio.gather(*(w.run(i, concurrency) for i, w in enumerate(workers)))
        duration = time.perf_counter() - t0
        probe.stop()
        return records, duration, time.process_time() - cpu0


async def _warm(stub: Any, workload: Workload) -> None:
    for index in range(max(workload.warmup, 1)):
        ask = workload.ask(index)
        request = stream_request(ask.prompt, ask.max_tokens, ask.model, f"warm-{index}")
        async for reply in stub.ModelStreamInfer(iter([request])):
            if reply.error_message or reply.infer_response.parameters[FINAL].bool_param:
                break


def record_grpc_window(
    run: Run, server: Server, workload: Workload, label: str, **tags: Any
) -> dict[str, Any]:
    probe = CpuProbe(server.pid, descendants(server.pid))
    wall = time.time()
    records, duration, client_cpu = uvloop.run(
        grpc_window(server.extra["grpc_address"], workload, probe)
    )
    summary = summarize(records, duration)
    return run.tool_window(
        "G", "grpc", server, label, settings={**workload.settings(), "protocol": "triton-grpc"},
        summary=summary, probe=probe, duration_s=duration, client_cpu_s=client_cpu,
        wall_start=wall, **tags,
    )


# ---- perf_analyzer ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PerfAnalyzer:
    binary: Path | None
    library_path: str
    how: str  # found, installed, or why not


def ensure_perf_analyzer() -> PerfAnalyzer:
    """tritonclient's perf_analyzer with its two missing libraries, or the reason it cannot
    run; never raises."""
    if not PERF_ANALYZER.exists():
        return PerfAnalyzer(None, "", f"{PERF_ANALYZER} is not installed (tritonclient wheel)")
    installed, how = _apt_install("libb64-0d") if not _has_libb64() else (True, "libb64 found")
    if not installed:
        return PerfAnalyzer(None, "", how)
    cudart = _cudart_dir()
    if cudart is None:
        why = f"libcudart.so.12 unavailable ({CUDART_WHEEL} not installable)"
        return PerfAnalyzer(None, "", why)
    probe = subprocess.run(
        [str(PERF_ANALYZER), "--version"], env=_env(str(cudart)), capture_output=True, text=True,
        timeout=30, check=False,
    )
    if "error while loading shared libraries" in probe.stderr:
        return PerfAnalyzer(None, "", probe.stderr.strip()[:200])
    return PerfAnalyzer(PERF_ANALYZER, str(cudart), f"{how}; libcudart from {cudart}")


def _has_libb64() -> bool:
    return any(Path(d).glob("libb64.so.0d") for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib"))


def _cudart_dir() -> Path | None:
    """libcudart.so.12 from the pip wheel, unpacked under build/tools (no other CUDA part)."""
    target = TOOLS / "cudart"
    found = next(target.rglob("libcudart.so.12"), None) if target.exists() else None
    if found is not None:
        return found.parent
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         CUDART_WHEEL],
        capture_output=True, text=True, timeout=300, check=False,
    )
    if done.returncode != 0:
        return None
    found = next(target.rglob("libcudart.so.12"), None)
    return found.parent if found else None


def _env(library_path: str) -> dict[str, str]:
    return {**os.environ, "LD_LIBRARY_PATH": library_path}


_PA_LINE = re.compile(
    r"Concurrency: (\d+), throughput: ([\d.]+) infer/sec, latency (\d+) usec"
)


def perf_analyzer_window(
    run: Run, server: Server, tool: PerfAnalyzer, workload: Workload, folder: Path
) -> dict[str, Any] | None:
    """perf_analyzer at the workload's concurrency against the gRPC listener, streaming (the
    model is decoupled). Its own figures: infer/s and the mean latency to the first response."""
    if tool.binary is None:
        run.note("perf_analyzer", skipped=tool.how)
        print(f"  perf_analyzer skipped: {tool.how}", flush=True)
        return None
    data = folder / "perf_analyzer_input.json"
    ask = workload.ask(0)
    sampling = json.dumps({"max_tokens": ask.max_tokens, "ignore_eos": True, "temperature": 0})
    data.write_text(json.dumps({"data": [{
        "text_input": [ask.prompt], "stream": [True], "sampling_parameters": [sampling],
        "exclude_input_in_output": [True],
    }]}))
    concurrency = workload.concurrency or 1
    window_ms = int(workload.duration_s * 1000)
    argv = [
        str(tool.binary), "-m", ask.model, "-i", "grpc", "-u", server.extra["grpc_address"],
        "--async", "--streaming", "--input-data", str(data), "--shape", "text_input:1",
        "--concurrency-range", str(concurrency), "--measurement-interval", str(window_ms),
        "--stability-percentage", "50", "--max-trials", "6",
    ]  # fmt: skip
    probe = CpuProbe(server.pid, descendants(server.pid))
    wall, cpu0 = time.time(), _children_cpu()
    probe.start()
    started = time.perf_counter()
    done = subprocess.run(argv, env=_env(tool.library_path), capture_output=True, text=True,
                          timeout=600, check=False)
    duration = time.perf_counter() - started
    probe.stop()
    (folder / "perf_analyzer.log").write_text(done.stdout + done.stderr)
    match = _PA_LINE.search(done.stdout)
    summary = {
        "tool": "perf_analyzer", "returncode": done.returncode, "how": tool.how,
        "infer_per_s": float(match.group(2)) if match else None,
        "first_response_latency_us": int(match.group(3)) if match else None,
        "failed": 0 if done.returncode == 0 and match else 1,
        "errors": [] if match else [(done.stdout + done.stderr).strip()[-300:]],
    }
    return run.tool_window(
        "G", "perf_analyzer", server, "triton-grpc-stream", settings={
            **workload.settings(), "protocol": "triton-grpc", "argv": argv[1:],
        }, summary=summary, probe=probe, duration_s=duration,
        client_cpu_s=_children_cpu() - cpu0, wall_start=wall,
    )  # fmt: skip


def _children_cpu() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


# ---- the scenario ------------------------------------------------------------------------------
def start_g_gateway(run: Run, engine: EngineSettings) -> Server:
    port = free_port()
    overrides = {"ServerConfig": {"grpcPort": port, "grpcHttpsEnabled": False}}
    server = start_gateway("g-gateway", run.logs, engine="vllm", engine_settings=engine,
                           overrides=overrides)
    server.extra["grpc_address"] = f"127.0.0.1:{port}"
    return server


def arms(rnd: int) -> tuple[str, ...]:
    """Which arm goes first alternates by round."""
    return ("http", "grpc") if rnd % 2 == 0 else ("grpc", "http")


def run_g(run: Run, plan: Any) -> None:
    """`plan`: bench.scenarios.Plan (its g_* fields)."""
    from bench.prompts import prompt_set
    from bench.scenarios import session

    prompts = prompt_set(plan.g_prompt_len, 32, str(DEMO / "model"))
    engine = EngineSettings()
    run.note("engine", scenario="G", settings=asdict(engine))
    workload = Workload(
        protocol="triton", stream=True, max_tokens=plan.g_max_tokens, prompts=prompts,
        concurrency=plan.g_concurrency, requests=1_000_000, duration_s=plan.g_window_s,
        warmup=4, prompt_len=plan.g_prompt_len,
    )
    server = start_g_gateway(run, engine)
    with session(server, run, "G", "gateway"):
        for rnd in range(plan.g_rounds):
            for arm in arms(rnd):
                if arm == "http":
                    run.window("G", "http", server, workload, "triton-stream", round=rnd)
                else:
                    record_grpc_window(run, server, workload, "triton-stream", round=rnd)
        perf_analyzer_window(run, server, ensure_perf_analyzer(), workload, run.logs)
