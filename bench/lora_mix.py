"""Scenario L: adapter traffic against base traffic, on the gateway's admission arms and on vLLM's
own server, all on the same engine flags (`maxNumSeqs` 32, `maxLoras` 2, `maxCpuLoras` 4).

Windows: the base model, then K = 2, 8, 32 and 128 adapters with distinct weights, each K in two
mixes: uniform (round robin over the K adapters) and skewed (Zipf: adapter of rank r drawn with
weight 1 / r^s, s = 1.1, from a fixed seed, so every arm gets the same sequence). Streamed chat,
fixed output length. Arms: vLLM's server, and the gateway with adapter slots (`slots`: the
default `LoraConfig.maxActiveAdapters`, the engine's 4 cached places; `strict`: 2, its
`maxLoras`; `spare`: 3, one cached place left for the next adapter in line), without them
(`fair`: `maxActiveAdapters` 0, as before issue 24) and one FIFO
without them (`fifo`, on request); they alternate at the server level each
round (which one starts first rotates); `fair` and `fifo` order only requests queued at
admission, so they differ only with more requests in flight than the gateway's
`maxConcurrentRequests` (`--l-concurrency`, `--l-limit`). Besides the usual figures, each window
records what does not depend on the machine's speed: the engine's running count sampled from
`/metrics` (`vllm:num_requests_running`, the scheduler's own number on both servers) and, on the
gateway, adapter loads per request (`vllm:lora_adapter_load_seconds_count`; vLLM's server has no
such counter).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import statistics
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.load import Workload
from bench.prompts import prompt_set
from bench.record import RESULTS, CpuProbe, Run
from bench.scenarios import Plan, rotated, session
from bench.servers import DEMO, EngineSettings, Server, descendants, start_gateway, start_vllm

RUNNING = "vllm:num_requests_running"
LOADS = "vllm:lora_adapter_load_seconds_count"
SAMPLE_S = 0.05
SCHEME = "scale 2 - 1/(index + 2)\n"  # how distinct_adapters scales lora_B; a change rebuilds

MIXES = ("uniform", "zipf")
ZIPF_S = 1.1  # the skew: rank 1 of 8 takes 0.37 of the requests, of 32 0.26, of 128 0.21
ZIPF_SEED = 24

@dataclass(frozen=True, slots=True)
class GatewayArm:
    """One gateway arm: its admission settings over the bench's config."""

    max_active: int | None  # LoraConfig.maxActiveAdapters; None: the default (maxCpuLoras)
    fair_admission: bool

    def overrides(self, *, cycle_s: float, limit: int | None) -> dict[str, Any]:
        limits: dict[str, Any] = {"fairAdmission": self.fair_admission}
        if limit is not None:
            limits["maxConcurrentRequests"] = limit
        lora: dict[str, Any] = {"adapterCycleTime": cycle_s}
        if self.max_active is not None:
            lora["maxActiveAdapters"] = self.max_active
        return {"LimitsConfig": limits, "LoraConfig": lora}


GATEWAY_ARMS = {
    "slots": GatewayArm(max_active=None, fair_admission=True),  # the default: maxCpuLoras (4)
    "strict": GatewayArm(max_active=2, fair_admission=True),  # maxLoras: the next ones prefetched
    # one cached place spare: the next adapter in line prefetched while three run
    "spare": GatewayArm(max_active=3, fair_admission=True),
    "fair": GatewayArm(max_active=0, fair_admission=True),  # no adapter slots (before issue 24)
    "fifo": GatewayArm(max_active=0, fair_admission=False),
}
ARMS = ("vllm", *GATEWAY_ARMS)
# fifo orders only requests queued at admission, which at the default concurrency is none
DEFAULT_ARMS = ("vllm", "slots", "strict", "fair")


def choose_arms(requested: Sequence[str] | None) -> tuple[str, ...]:
    """The arms to run: `requested` as given (unknown names refused), else `DEFAULT_ARMS`."""
    if requested is None:
        return DEFAULT_ARMS
    unknown = [arm for arm in requested if arm not in ARMS]
    if unknown or not requested:
        raise ValueError(f"unknown arms {unknown or requested}: choose from {', '.join(ARMS)}")
    return tuple(requested)


def distinct_adapters(count: int, source: Path, folder: Path, prefix: str = "l") -> list[str]:
    """`count` adapters named l00.. with distinct weights: copies of `source` whose lora_B
    tensors are scaled by their own factor (same rank and modules, so the same cost), and their
    own name as `revision`. The factor depends on the index only, so a larger count adds copies
    and keeps the ones made before; a folder made under another scheme (`SCHEME`) is rebuilt."""
    from safetensors.numpy import load_file, save_file

    marker = folder / "SCHEME"
    if folder.exists() and (not marker.exists() or marker.read_text() != SCHEME):
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    marker.write_text(SCHEME)
    names = [f"{prefix}{i:02d}" for i in range(count)]
    for index, name in enumerate(names):
        target = folder / name
        if target.exists():
            continue
        staging = folder / f".{name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(source, staging)
        weights_path = staging / "adapter_model.safetensors"
        scale = 2.0 - 1.0 / (index + 2)
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


def zipf_sequence(names: Sequence[str], length: int, s: float = ZIPF_S,
                  seed: int = ZIPF_SEED) -> tuple[str, ...]:
    """`length` draws from `names`, the one of rank r (1 first) with weight 1 / r^s, from a
    fixed seed: the same sequence for every arm and every run."""
    weights = [1.0 / rank**s for rank in range(1, len(names) + 1)]
    return tuple(random.Random(seed).choices(list(names), weights=weights, k=length))


def mixes(names: Sequence[str], counts: Sequence[int], kinds: Sequence[str] = MIXES,
          length: int = 192, s: float = ZIPF_S) -> list[tuple[str, tuple[str, ...]]]:
    """("base", the base model), then for each K and mix ("K-uniform", the first K adapters,
    taken round robin) and ("K-zipf", `length` Zipf draws from them, taken in that order)."""
    out: list[tuple[str, tuple[str, ...]]] = [("base", ("tiny",))]
    for k in counts:
        for kind in kinds:
            if kind not in MIXES:
                raise ValueError(f"unknown mix {kind!r}: choose from {', '.join(MIXES)}")
            chosen = tuple(names[:k])
            out.append((f"{k}-{kind}", chosen if kind == "uniform" else
                        zipf_sequence(chosen, length, s)))
    return out


def label_parts(label: str) -> tuple[int, str]:
    """A window label's K and mix: "base" (K 0), "K-uniform", "K-zipf", and "K-adapters" of
    runs before the mixes (uniform)."""
    if label == "base":
        return 0, "base"
    count, _, kind = label.partition("-")
    return int(count), "uniform" if kind == "adapters" else kind


def l_workload(models: tuple[str, ...], prompts: tuple[str, ...], requests: int,
               concurrency: int, max_tokens: int) -> Workload:
    return Workload(
        protocol="openai-chat", stream=True, max_tokens=max_tokens, prompts=prompts,
        models=models, concurrency=concurrency, requests=requests, warmup=concurrency,
        prompt_len=32,
    )


def run_l(run: Run, plan: Plan) -> list[dict[str, Any]]:
    """Every round: each arm's server started in turn (the first arm rotating), every mix's
    window on it (the first window rotating too: the window right after a start runs on a
    fresh process). Returns one figure row per window."""
    folder = RESULTS / "adapters-l"
    names = distinct_adapters(max(plan.l_adapters), DEMO / "adapters" / "a1", folder)
    engine = EngineSettings(max_num_seqs=32, max_loras=2, max_cpu_loras=4, adapter_dir=str(folder))
    arms = choose_arms(plan.l_arms)
    overrides = {arm: GATEWAY_ARMS[arm].overrides(cycle_s=plan.l_cycle_s,
                                                  limit=plan.l_gateway_limit)
                 for arm in arms if arm in GATEWAY_ARMS}
    run.note("engine", scenario="L", **engine.describe(), arms=list(arms),
             gateway_overrides=overrides, mixes=list(plan.l_mixes), zipf_s=plan.l_zipf_s,
             zipf_seed=ZIPF_SEED)
    prompts = prompt_set(32, 128, engine.model)
    windows = tuple(mixes(names, plan.l_adapters, plan.l_mixes, plan.l_requests, plan.l_zipf_s))
    rows: list[dict[str, Any]] = []
    for rnd in range(plan.l_rounds):
        for arm in rotated(arms, rnd):
            name = f"L-{arm}-r{rnd}"
            server = start_l_arm(arm, name, run, engine, overrides.get(arm, {}))
            with session(server, run, "L", arm, round=rnd):
                for label, models in rotated(windows, rnd):
                    workload = l_workload(models, prompts, plan.l_requests, plan.l_concurrency,
                                          plan.l_max_tokens)
                    probe = EngineSampler(server)
                    row = run.window("L", arm, server, workload, label, probe=probe, round=rnd)
                    figures = probe.figures(row["summary"]["completed"])
                    run.note("engine_running", scenario="L", window=row["id"], arm=arm,
                             label=label, round=rnd, **figures)
                    rows.append(window_row(row, figures))
    print(table(rows), flush=True)
    return rows


def start_l_arm(arm: str, name: str, run: Run, engine: EngineSettings,
                overrides: dict[str, Any]) -> Server:
    print(f"  starting {name} ...", flush=True)
    if arm == "vllm":
        return start_vllm(name, run.logs, engine)
    return start_gateway(name, run.logs, engine="vllm", engine_settings=engine,
                         overrides=overrides)


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


def curves(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The medians as plot lines: per (arm, mix), its points by K, the arm's base point (K 0)
    first on every mix's line."""
    found = medians(rows)
    bases = {m["arm"]: m for m in found if m["label"] == "base"}
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for m in found:
        count, kind = label_parts(m["label"])
        if kind == "base":
            continue
        line = lines.setdefault((m["arm"], kind), [])
        if not line and m["arm"] in bases:
            line.append({**bases[m["arm"]], "k": 0})
        line.append({**m, "k": count})
    for line in lines.values():
        line.sort(key=lambda point: point["k"])
    return lines


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
