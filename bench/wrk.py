"""wrk, the C HTTP load generator, as a second client for scenario B's requests (non-streamed and
streamed).

Why: on this 2-core box the Python load generator (bench/load.py) spends about as much CPU per
request as the bare Starlette endpoint it measures, so against the bare arm it measures itself
as much as the server. wrk (one thread, epoll, a static request built once) costs a fraction
of that. Each run POSTs exactly the request the Python client sends for the same workload:
same path, body bytes and headers (Host, Content-Type, Content-Length), on keep-alive
connections.

- `ensure_wrk()` finds wrk, or installs the Debian package with apt-get (root only), else says
  why not; the harness then skips the wrk arm with that note.
- `lua_script()` writes the request into a wrk Lua script (no `request()` function, so wrk
  formats the request once and replays the same bytes on every connection).
- `parse_wrk()` reads wrk's text report (`--latency`): requests/s, latency distribution,
  socket errors and non-2xx/3xx responses; a run with any of those is `flagged`.

Streamed requests: wrk reads every chunked response to its end, so its requests/s times the
events in one response is events/s. The events per response come from the bare arm's capture
(`count_stream()` over the events it replays), and each window is checked with one request of
our own (`fetch_once()`, `check_problems()`) plus the exact byte count wrk read, which a `done()`
callback prints once at the end (`bytes_problem()`). No `response()` callback: with one, wrk
hands every response's headers and body to Lua, a per-response cost on the load generator.

Plain HTTP only: wrk speaks TLS but cannot present a client certificate, and the TLS arms of
scenario B require one (mutual TLS).
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.protocols import Protocol

_INSTALL_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class WrkTool:
    """Where wrk is (None: not available, `note` says why)."""

    path: str | None
    version: str | None
    note: str


def ensure_wrk() -> WrkTool:
    """wrk on PATH, else `apt-get install -y wrk` (after `apt-get update` if the first try
    fails); never raises."""
    found = shutil.which("wrk")
    how = "found on PATH"
    if found is None:
        installed, how = _apt_install("wrk")
        found = shutil.which("wrk") if installed else None
        if found is None:
            return WrkTool(None, None, how)
    return WrkTool(found, _version(found), f"{found} ({how})")


def _apt_install(package: str) -> tuple[bool, str]:
    if shutil.which("apt-get") is None:
        return False, f"{package} is not installed and apt-get is not available"
    if os.geteuid() != 0:
        return False, f"{package} is not installed; `apt-get install {package}` needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", package]
    attempts = ([install], [["apt-get", "update", "-q"], install])
    output = ""
    for steps in attempts:
        print(f"  installing {package}: {' && '.join(' '.join(s) for s in steps)}", flush=True)
        for step in steps:
            try:
                done = subprocess.run(
                    step, env=env, capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                output = repr(exc)
                break
            output = (done.stdout + done.stderr).strip()
            if done.returncode != 0:
                break
        else:
            return True, f"installed with `{' '.join(install)}`"
    last = output.splitlines()[-1] if output else "no output"
    return False, f"`apt-get install {package}` failed: {last[:200]}"


def _version(path: str) -> str | None:
    try:
        done = subprocess.run([path, "-v"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"wrk (\S+)", done.stdout + done.stderr)
    return match.group(1) if match else None


# -- the request ------------------------------------------------------------------------------


def lua_string(data: bytes) -> str:
    """`data` as a double-quoted Lua string literal, byte for byte (printable ASCII as is,
    everything else as a three-digit decimal escape, so a following digit cannot join it)."""
    out = ['"']
    for byte in data:
        char = chr(byte)
        if char in '"\\':
            out.append("\\" + char)
        elif 0x20 <= byte < 0x7F:
            out.append(char)
        else:
            out.append(f"\\{byte:03d}")
    out.append('"')
    return "".join(out)


# Printed once by the script's done() callback: wrk's exact totals (its report rounds bytes).
_DONE_LINE = "bench-totals: requests %.0f bytes %.0f\\n"
_DONE_PATTERN = r"^bench-totals: requests (\d+) bytes (\d+)$"


def lua_script(
    method: str, path: str, body: bytes, headers: dict[str, str], *, totals: bool = False
) -> str:
    """A wrk script sending one fixed request. wrk adds Host (from the URL) and Content-Length
    (from the body) itself, as the Python client does; `headers` are the rest. `totals`: a
    done() callback prints the exact count of completed requests and bytes read (once, after
    the run; nothing per request)."""
    lines = [
        "-- generated by bench/wrk.py: the same request as the Python load generator's",
        f"wrk.method = {lua_string(method.encode())}",
        f"wrk.path = {lua_string(path.encode())}",
        f"wrk.body = {lua_string(body)}",
    ]
    lines += [
        f"wrk.headers[{lua_string(k.encode())}] = {lua_string(v.encode())}"
        for k, v in headers.items()
    ]
    if totals:
        lines += [
            "function done(summary, latency, requests)",
            f'  io.write(string.format("{_DONE_LINE}", summary.requests, summary.bytes))',
            "end",
        ]
    return "\n".join(lines) + "\n"


# -- the report -------------------------------------------------------------------------------

_TIME_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}  # to milliseconds
_METRIC_UNITS = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9}
_TIME = r"([0-9.]+)(us|ms|s|m|h)"


@dataclass(slots=True)
class WrkResult:
    """What one wrk run reported. Latencies in milliseconds."""

    requests: int = 0
    duration_s: float = 0.0
    req_per_s: float | None = None
    latency_ms: dict[str, float] = field(default_factory=dict)  # mean, stdev, max, p50..p99
    socket_errors: dict[str, int] = field(default_factory=dict)  # connect, read, write, timeout
    non_2xx: int = 0  # wrk counts statuses above 399 ("Non-2xx or 3xx responses")
    connections: int | None = None
    threads: int | None = None
    bytes_read: int | None = None  # exact, from the script's done() line (streamed runs)
    problems: list[str] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return self.non_2xx + sum(self.socket_errors.values())

    @property
    def flagged(self) -> bool:
        """Not a clean measurement: error responses, socket errors, or an unreadable report."""
        return bool(self.errors or self.problems or self.req_per_s is None or not self.requests)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(errors=self.errors, flagged=self.flagged)
        return out


def _ms(value: str, unit: str) -> float:
    return float(value) * _TIME_UNITS[unit]


def _metric(text: str) -> float:
    match = re.fullmatch(r"([0-9.]+)([kMG]?)", text)
    if match is None:
        raise ValueError(f"not a wrk figure: {text!r}")
    return float(match.group(1)) * _METRIC_UNITS[match.group(2)]


def parse_wrk(text: str) -> WrkResult:
    """Read wrk 4's text report (with `--latency`). Missing parts leave their defaults and a
    line in `problems`; nothing raises."""
    result = WrkResult()
    if match := re.search(r"(\d+) threads and (\d+) connections", text):
        result.threads, result.connections = int(match.group(1)), int(match.group(2))
    _parse_latency(text, result)
    if match := re.search(r"(\d+) requests in ([0-9.]+)(us|ms|s|m|h)", text):
        result.requests = int(match.group(1))
        result.duration_s = _ms(match.group(2), match.group(3)) / 1000
    else:
        result.problems.append("no 'N requests in T' line")
    if match := re.search(r"Requests/sec:\s+([0-9.]+[kMG]?)", text):
        result.req_per_s = _metric(match.group(1))
    else:
        result.problems.append("no 'Requests/sec' line")
    if match := re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text
    ):
        names = ("connect", "read", "write", "timeout")
        result.socket_errors = {n: int(v) for n, v in zip(names, match.groups(), strict=True)}
    if match := re.search(r"Non-2xx or 3xx responses: (\d+)", text):
        result.non_2xx = int(match.group(1))
    if match := re.search(_DONE_PATTERN, text, re.MULTILINE):
        result.bytes_read = int(match.group(2))
    return result


def _parse_latency(text: str, result: WrkResult) -> None:
    pattern = rf"^\s*Latency\s+{_TIME}\s+{_TIME}\s+{_TIME}"
    if match := re.search(pattern, text, re.MULTILINE):
        groups = match.groups()
        for index, name in enumerate(("mean", "stdev", "max")):
            result.latency_ms[name] = _ms(groups[2 * index], groups[2 * index + 1])
    for match in re.finditer(rf"^\s*(\d+(?:\.\d+)?)%\s+{_TIME}\s*$", text, re.MULTILINE):
        result.latency_ms[f"p{match.group(1).removesuffix('.0')}"] = _ms(
            match.group(2), match.group(3)
        )
    if "p50" not in result.latency_ms:
        result.problems.append("no latency distribution (--latency)")


# -- running it --------------------------------------------------------------------------------


@dataclass(slots=True)
class WrkRun:
    """One wrk process: its report, its own CPU time (user + system) and wall time."""

    argv: list[str]
    returncode: int
    output: str
    cpu_s: float
    wall_s: float
    wall_start: float
    result: WrkResult


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_wrk(
    wrk: str,
    url: str,
    script: Path,
    *,
    connections: int,
    duration_s: int,
    threads: int = 1,
    cpu: int | None = None,
    timeout_s: float = 5.0,
) -> WrkRun:
    """Run wrk to completion (pinned to `cpu` with taskset when given) and parse its report.
    The CPU figure is wrk's own (children's rusage around this one process)."""
    argv = [
        wrk, f"-t{threads}", f"-c{connections}", f"-d{duration_s}s", "--latency",
        f"--timeout={timeout_s:g}s", "-s", str(script), url,
    ]  # fmt: skip
    if cpu is not None and shutil.which("taskset"):
        argv = ["taskset", "-c", str(cpu), *argv]
    cpu0, wall0, wall_start = _children_cpu(), time.perf_counter(), time.time()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, output = -1, f"wrk timed out: {exc!r}"
    wall = time.perf_counter() - wall0
    result = parse_wrk(output)
    if returncode != 0:
        result.problems.append(f"wrk exited with {returncode}: {output.strip()[-200:]}")
    return WrkRun(argv, returncode, output, _children_cpu() - cpu0, wall, wall_start, result)


# -- streamed responses: events per response, one checked request, wrk's byte count -----------


@dataclass(frozen=True, slots=True)
class StreamCount:
    """What one streamed body holds, counted as the Python client reads it."""

    events: int  # pieces between delimiters: the chunks the bare arm replays
    text_events: int  # token events (the Python client's "events", events/s = these / s)
    tokens: int | None  # completion tokens the stream itself reported (usage, details), if any
    error: str | None  # an in-band error event, or an event that does not parse
    body_bytes: int


def split_events(body: bytes, delimiter: bytes) -> list[bytes]:
    """The events of a streamed body, each with its delimiter (blank pieces dropped): what the
    harness captures from the gateway and the bare arm replays, one chunk each."""
    return [e + delimiter for e in body.split(delimiter) if e.strip(b"\n\0")]


def count_stream(protocol: Protocol, body: bytes) -> StreamCount:
    """Events and token events of a streamed body of `protocol` (bench/protocols.py's reading,
    the one the Python load generator uses)."""
    events = split_events(body, protocol.delimiter)
    text_events = 0
    tokens: int | None = None
    error: str | None = None
    for raw in events:
        try:
            event = protocol.event(raw[: -len(protocol.delimiter)])
        except ValueError as exc:  # orjson's decode error is one
            error = error or f"unreadable event {raw[:60]!r}: {exc}"
            continue
        text_events += event.text
        if event.tokens is not None:
            tokens = event.tokens
        if event.error is not None:
            error = error or event.error
    return StreamCount(len(events), text_events, tokens, error, len(body))


def check_problems(status: int, found: StreamCount, expected: StreamCount) -> list[str]:
    """Why one checked streamed response does not match the captured one (empty: it does)."""
    problems = [f"check request answered {status}"] if status != 200 else []
    if found.error is not None:
        problems.append(f"check request: {found.error[:120]}")
    if found.text_events != expected.text_events:
        problems.append(
            f"check request: {found.text_events} token events, the capture has "
            f"{expected.text_events}"
        )
    if found.events != expected.events:
        problems.append(f"check request: {found.events} events, the capture has {expected.events}")
    return problems


BYTES_TOLERANCE = 0.05  # responses differ by a few bytes (ids, timings printed as numbers)


def bytes_problem(
    bytes_read: int | None,
    requests: int,
    connections: int,
    wire_bytes: int,
    tolerance: float = BYTES_TOLERANCE,
) -> str | None:
    """Whether wrk's byte count fits `requests` whole responses of `wire_bytes` each (head,
    chunk framing and body, as one checked response measured): at least that many (a cut-off
    stream reads fewer), at most that plus one partial response per connection still open when
    wrk stopped. None when it fits."""
    if bytes_read is None:
        return "no byte count from wrk (the script's done() line is missing)"
    if requests <= 0 or wire_bytes <= 0:
        return None  # nothing completed: flagged anyway
    per = bytes_read / requests
    low = wire_bytes * (1 - tolerance)
    high = wire_bytes * (1 + tolerance) * (requests + connections) / requests
    if low <= per <= high:
        return None
    return (
        f"wrk read {per:.0f} bytes per response, one checked response is {wire_bytes} "
        f"(expected {low:.0f}–{high:.0f})"
    )


@dataclass(frozen=True, slots=True)
class RawResponse:
    """One HTTP/1.1 response as it came off the wire."""

    status: int
    headers: dict[str, str]
    body: bytes  # transfer chunks decoded
    wire_bytes: int  # status line, headers, framing and body
    chunks: int | None  # transfer chunks (None: a Content-Length body)


def parse_response(raw: bytes) -> RawResponse | None:
    """The first complete response in `raw` (chunked or Content-Length), None while
    incomplete. Raises ValueError on what is not HTTP/1.1."""
    head_end = raw.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    lines = raw[:head_end].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    status, start = int(parts[1]), head_end + 4
    if "chunked" in headers.get("transfer-encoding", "").lower():
        found = _dechunk(raw, start)
        if found is None:
            return None
        body, end, chunks = found
        return RawResponse(status, headers, body, end, chunks)
    end = start + int(headers.get("content-length", "0"))
    return RawResponse(status, headers, raw[start:end], end, None) if len(raw) >= end else None


def _dechunk(raw: bytes, pos: int) -> tuple[bytes, int, int] | None:
    """A chunked body from `pos`: (body, where the message ends, chunks), None if incomplete."""
    body = bytearray()
    chunks = 0
    while (eol := raw.find(b"\r\n", pos)) >= 0:
        size = int(raw[pos:eol].split(b";", 1)[0], 16)
        pos = eol + 2
        if size == 0:
            while (eol := raw.find(b"\r\n", pos)) >= 0:  # trailers, up to the blank line
                line, pos = raw[pos:eol], eol + 2
                if not line:
                    return bytes(body), pos, chunks
            return None
        if len(raw) < pos + size + 2:
            return None
        body += raw[pos : pos + size]
        pos += size + 2
        chunks += 1
    return None


def request_bytes(method: str, path: str, host: str, body: bytes, headers: dict[str, str]) -> bytes:
    """The request as wrk writes it from the script (Host from the URL, Content-Length)."""
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def fetch_once(
    url: str, method: str, path: str, body: bytes, headers: dict[str, str], timeout_s: float = 10.0
) -> RawResponse:
    """One plain-HTTP request on a fresh connection, read to the end of its response (the
    check next to a wrk window). Raises OSError or ValueError."""
    hostport = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    deadline = time.monotonic() + timeout_s
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as conn:
        conn.sendall(request_bytes(method, path, hostport, body, headers))
        raw = bytearray()
        while (parsed := parse_response(bytes(raw))) is None:
            conn.settimeout(max(deadline - time.monotonic(), 0.01))
            data = conn.recv(1 << 16)
            if not data:
                raise ValueError(f"connection closed after {len(raw)} bytes, response incomplete")
            raw += data
    return parsed
