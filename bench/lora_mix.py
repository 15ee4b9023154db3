"""Scenario L: adapter traffic against base traffic, the gateway and vLLM's own server side by
side on the same engine flags (`maxNumSeqs` 32, `maxLoras` 2, `maxCpuLoras` 4).

Windows: the base model, then 2, 8 and 32 adapters with distinct weights drawn uniformly (round
robin over the requests), streamed chat, fixed output length. The arms alternate at the server
level each round (which one starts first rotates). Besides the usual figures, each window
records what does not depend on the machine's speed: the engine's running count sampled from
`/metrics` (`vllm:num_requests_running`, the scheduler's own number on both servers) and, on the
gateway, adapter loads per request (`vllm:lora_adapter_load_seconds_count`; vLLM's server has no
such counter).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import threading
from pathlib import Path
from typing import Any

import httpx

from bench.load import Workload
from bench.prompts import prompt_set
from bench.record import RESULTS, CpuProbe, Run
from bench.servers import DEMO, EngineSettings, Server, descendants

RUNNING = "vllm:num_requests_running"
LOADS = "vllm:lora_adapter_load_seconds_count"
SAMPLE_S = 0.05


def distinct_adapters(count: int, source: Path, folder: Path, prefix: str = "l") -> list[str]:
    """`count` adapters named l00.. with distinct weights: copies of `source` whose lora_B
    tensors are scaled by their own factor (same rank and modules, so the same cost), and their
    own name as `revision`."""
    from safetensors.numpy import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    names = [f"{prefix}{i:02d}" for i in range(count)]
    for index, name in enumerate(names):
        target = folder / name
        if target.exists():
            continue
        staging = folder / f".{name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(source, staging)
        weights_path = staging / "adapter_model.safetensors"
        scale = 1.0 + (index + 1) / (count + 1)
        tensors = {key: value * scale if "lora_B" in key else value
                   for key, value in load_file(str(weights_path)).items()}
        save_file(tensors, str(weights_path))
        config_path = staging / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["revision"] = name
        config_path.write_text(json.dumps(config, indent=2))
        staging.rename(target)
    return names


def metric_total(text: str, name: str) -> float:
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(value) for value in pattern.findall(text))


class EngineSampler(CpuProbe):
    """The CPU probe, plus the engine's running count sampled from `/metrics` over the timed
    part of the window, and the adapter loads counted over it."""

    def __init__(self, server: Server) -> None:
        super().__init__(server.pid, descendants(server.pid))
        base = server.metrics_url or server.url
        self.url = f"{base}/metrics"
        self.samples: list[float] = []
        self.loads: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loads_at_start: float | None = None

    def start(self) -> None:
        super().start()
        self._loads_at_start = self._loads()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        super().stop()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        end = self._loads()
        if self._loads_at_start is not None and end is not None:
            self.loads = end - self._loads_at_start

    def figures(self, requests: int) -> dict[str, Any]:
        running = self.samples or [0.0]
        return {
            "running_max": max(running),
            "running_mean": statistics.fmean(running),
            "running_p50": statistics.median(running),
            "running_samples": len(self.samples),
            "loads": self.loads,
            "loads_per_request": None if self.loads is None else self.loads / max(requests, 1),
        }

    def _loads(self) -> float | None:
        try:
            text = httpx.get(self.url, timeout=10).text
        except httpx.HTTPError:
            return None
        return metric_total(text, LOADS) if LOADS in text else None

    def _poll(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                try:
                    self.samples.append(metric_total(client.get(self.url).text, RUNNING))
                except httpx.HTTPError:
                    pass
                self._stop.wait(SAMPLE_S)


def mixes(names: list[str], counts: tuple[int, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """("base", the base model), then ("K-adapters", the first K adapters) for each K."""
    out: list[tuple[str, tuple[str, ...]]] = [("base", ("tiny",))]
    out += [(f"{k}-adapters", tuple(names[:k])) for k in counts]
    return out


def l_workload(models: tuple[str, ...], prompts: tuple[str, ...], requests: int,
               concurrency: int, max_tokens: int) -> Workload:
    return Workload(
        protocol="openai-chat", stream=True, max_tokens=max_tokens, prompts=prompts,
        models=models, concurrency=concurrency, requests=requests, warmup=concurrency,
        prompt_len=32,
    )


def run_l(run: Run, rounds: int, requests: int, concurrency: int, max_tokens: int,
          counts: tuple[int, ...]) -> list[dict[str, Any]]:
    """Every round: each arm's server started in turn (the first arm rotating), every mix's
    window on it. Returns one figure row per window."""
    from bench.scenarios import rotated, session, start_arm

    folder = RESULTS / "adapters-l"
    names = distinct_adapters(max(counts), DEMO / "adapters" / "a1", folder)
    engine = EngineSettings(max_num_seqs=32, max_loras=2, max_cpu_loras=4, adapter_dir=str(folder))
    run.note("engine", scenario="L", **engine.describe())
    prompts = prompt_set(32, 128, engine.model)
    rows: list[dict[str, Any]] = []
    for rnd in range(rounds):
        for arm in rotated(("vllm", "gateway"), rnd):
            name = f"L-{arm}-r{rnd}"
            with session(start_arm(arm, name, run, engine), run, "L", arm, round=rnd) as server:
                for label, models in mixes(names, counts):
                    workload = l_workload(models, prompts, requests, concurrency, max_tokens)
                    probe = EngineSampler(server)
                    row = run.window("L", arm, server, workload, label, probe=probe, round=rnd)
                    figures = probe.figures(row["summary"]["completed"])
                    run.note("engine_running", scenario="L", window=row["id"], arm=arm,
                             label=label, round=rnd, **figures)
                    rows.append(window_row(row, figures))
    print(table(rows), flush=True)
    return rows


FIGURES = ("req_per_s", "of_base", "ttft_p50_ms", "ttft_p99_ms", "running_mean", "running_max",
           "loads_per_request")


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per arm and mix (in first-seen order): the median of each figure over the rounds, and the
    median rate over the arm's median base rate (`of_base`)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["arm"], row["label"]), []).append(row)

    def median(group: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in group if r.get(key) is not None]
        return statistics.median(values) if values else None

    out = []
    for (arm, label), group in groups.items():
        figures = {key: median(group, key) for key in FIGURES if key != "of_base"}
        base = median(groups.get((arm, "base"), []), "req_per_s")
        rate = figures["req_per_s"]
        figures["of_base"] = rate / base if rate is not None and base else None
        out.append({"arm": arm, "label": label, "rounds": len(group), **figures})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The medians as plain text (printed at the end of the scenario)."""
    lines = ["arm      mix          req/s  of-base  ttft-p50  ttft-p99  run-mean  run-max  "
             "loads/req"]
    for m in medians(rows):
        loads = m["loads_per_request"]
        lines.append(
            f"{m['arm']:<8} {m['label']:<12} {m['req_per_s'] or 0:6.1f}  {m['of_base'] or 0:6.2f}  "
            f"{m['ttft_p50_ms'] or 0:8.0f}  {m['ttft_p99_ms'] or 0:8.0f}  "
            f"{m['running_mean'] or 0:8.1f}  {m['running_max'] or 0:7.0f}  "
            f"{'-' if loads is None else f'{loads:.2f}':>9}"
        )
    return "\n".join(lines)


def window_row(window: dict[str, Any], figures: dict[str, Any]) -> dict[str, Any]:
    """One window's figures as `medians` takes them (from a run's records, or live)."""
    summary = window["summary"]
    return {"arm": window["arm"], "label": window["label"], "round": window["tags"].get("round"),
            "req_per_s": summary["req_per_s"], "ttft_p50_ms": summary["ttft_ms"]["median"],
            "ttft_p99_ms": summary["ttft_ms"]["p99"], **figures}
