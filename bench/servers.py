"""The servers under test, each a real process on loopback: the gateway (vLLM or fake engine),
vLLM's own OpenAI server, and the bare Starlette + uvicorn floor (`bench/bare.py`).

`EngineSettings` is the single source of the engine flags: the vLLM command line and the
gateway's ModelConfig/LoraConfig are both generated from it, so the two arms cannot drift, and
the engine-config line each engine core logs is kept to prove it.
Only one server runs at a time (memory and the 2 cores); `stop()` waits for the whole tree.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "build" / "demo"
CERTS = ROOT / "certs"
PY = sys.executable

# Both arms get exactly this environment for the engine (VLLM_CPU.md §4, §5).
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
    "PYTHONUNBUFFERED": "1",
}


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port the kernel picked (port 0) can be
    taken again by any outgoing connection or by an engine's own ZMQ socket before the server
    binds it (seen: a replica refused to start, its port "already in use"). Never the same port
    twice in one process (a benchmark or a test session)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 16384), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:  # a crowded range: the kernel's choice, as before
        sock.bind(("127.0.0.1", 0))
        chosen: int = sock.getsockname()[1]
        return chosen


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """vLLM engine flags shared by both arms. Explicit where the two launchers' defaults differ
    (vLLM's server derives max_num_seqs / max_num_batched_tokens from its usage context)."""

    model: str = str(DEMO / "model")
    served_name: str = "tiny"
    dtype: str = "float32"
    max_model_len: int = 512
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = 2048  # None: each launcher's default (the same)
    enforce_eager: bool = True
    seed: int = 0
    enable_lora: bool = True
    max_loras: int = 2
    max_lora_rank: int = 8
    max_cpu_loras: int = 4
    adapter_dir: str = str(DEMO / "adapters")  # every sub-directory is an adapter
    kv_cache_gib: int = 1
    allow_long_context: bool = False  # VLLM_ALLOW_LONG_MAX_MODEL_LEN (model has 512 positions)

    def adapters(self) -> list[tuple[str, str]]:
        folder = Path(self.adapter_dir)
        return [(d.name, str(d)) for d in sorted(folder.iterdir()) if d.is_dir()]

    def env(self, *, runtime_lora_updates: bool = True) -> dict[str, str]:
        """The engine environment of both arms. `runtime_lora_updates=False` leaves out
        VLLM_ALLOW_RUNTIME_LORA_UPDATING, which vLLM's server refuses with more than one API
        server (scenario W; adapters are then given at start, `--lora-modules`)."""
        env = {**ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}
        if not runtime_lora_updates:
            del env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
        if self.allow_long_context:
            env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        return env

    def vllm_args(self) -> list[str]:
        args = [
            "--model", self.model, "--served-model-name", self.served_name,
            "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs), "--seed", str(self.seed),
        ]  # fmt: skip
        if self.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.enable_lora:
            args += [
                "--enable-lora", "--max-loras", str(self.max_loras),
                "--max-lora-rank", str(self.max_lora_rank),
                "--max-cpu-loras", str(self.max_cpu_loras),
                "--lora-modules", *(f"{n}={p}" for n, p in self.adapters()),
            ]  # fmt: skip
        return args

    def gateway_sections(self) -> dict[str, Any]:
        batched = self.max_num_batched_tokens
        return {
            "ModelConfig": {
                "modelName": self.served_name,
                "modelWeightPath": self.model,
                "dtype": self.dtype,
                "maxModelLen": self.max_model_len,
                "maxNumSeqs": self.max_num_seqs,
                "seed": self.seed,
                "enforceEager": self.enforce_eager,
                "kvCacheSpaceGiB": self.kv_cache_gib,
                "engineOptions": {} if batched is None else {"max_num_batched_tokens": batched},
            },
            "LoraConfig": {
                "enabled": self.enable_lora,
                "maxLoras": self.max_loras,
                "maxLoraRank": self.max_lora_rank,
                "maxCpuLoras": self.max_cpu_loras,
                "adapterDir": self.adapter_dir,
                "adapterRoots": [str(Path(self.adapter_dir).parent)],
            },
        }

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "adapters": [n for n, _ in self.adapters()]}


@dataclass(slots=True)
class Server:
    """A running server process."""

    name: str
    kind: str  # gateway | vllm | bare
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    management_url: str | None = None
    metrics_url: str | None = None
    tls: ssl.SSLContext | None = None
    started_s: float = 0.0  # seconds until ready
    ready_at: float = 0.0  # wall clock when it turned ready
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60.0) -> None:
        tree = descendants(self.pid)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        _reap(tree, timeout=20.0)


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _reap(pids: list[int], timeout: float) -> None:
    """Engine cores and workers outliving their parent get SIGTERM, then SIGKILL."""
    wait_s = timeout
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in [p for p in pids if process_alive(p)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        if not alive_after(pids, wait_s):
            return
        wait_s = 5.0


def alive_after(pids: Sequence[int], timeout_s: float) -> list[int]:
    """Those of `pids` still running after waiting up to `timeout_s` for them to end."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if process_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if process_alive(p)]
    return alive


def process_alive(pid: int) -> bool:
    """Running: not gone and not a zombie (an adopted process nobody reaps stays one)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (children excluded)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (peak) of the process itself, children excluded."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def _affinity(cpus: set[int] | None) -> Any:
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _spawn(
    name: str, kind: str, argv: list[str], env: dict[str, str], log_dir: Path, cpus: set[int] | None
) -> tuple[subprocess.Popen[bytes], Path]:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as log:
        log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            preexec_fn=_affinity(cpus),
        )
    return process, log_path


def wait_ready(server: Server, path: str, timeout: float = 240.0) -> None:
    t0 = time.monotonic()
    deadline = t0 + timeout
    verify: Any = server.tls if server.tls is not None else True
    with httpx.Client(verify=verify, timeout=3.0) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(f"{server.name} exited:\n{server.log()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(server.url + path).status_code == 200:
                    server.started_s = time.monotonic() - t0
                    server.ready_at = time.time()
                    return
            time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"{server.name} not ready after {timeout}s:\n{server.log()[-3000:]}")


def tls_client_context() -> ssl.SSLContext:
    from bench.http import client_tls

    return client_tls(CERTS / "ca.pem", CERTS / "client.pem", CERTS / "client.key")


def gateway_config(
    engine: str, engine_settings: EngineSettings | None, tls: bool, overrides: dict[str, Any]
) -> dict[str, Any]:
    """The gateway's config: plain HTTP data/management/metrics (or TLS on data), no access log."""
    server: dict[str, Any] = {
        "ipAddress": "127.0.0.1",
        "port": free_port(),
        "managementPort": free_port(),
        "metricsPort": free_port(),
        "httpsEnabled": tls,
        "managementHttpsEnabled": False,
        "metricsHttpsEnabled": False,
        "tlsCaPath": str(CERTS),
        "tlsCaFile": ["ca.pem"],
        "tlsCert": str(CERTS / "server.pem"),
        "tlsPk": str(CERTS / "server.key"),
        "tlsCrlPath": str(CERTS),
        "tlsCrlFiles": ["crl.pem"],
        "maxLinkNum": 1000,
    }
    config: dict[str, Any] = {
        "engine": engine,
        "ServerConfig": server,
        "LimitsConfig": {"maxConcurrentRequests": 512, "maxQueue": 1024},
        "LoggingConfig": {"accessLog": False},
    }
    if engine_settings is not None:
        config.update(engine_settings.gateway_sections())
    else:
        config["LoraConfig"] = {
            "enabled": True,
            "adapterDir": str(DEMO / "adapters"),
            "adapterRoots": [str(DEMO)],
        }
    return _merge(config, overrides)


def _merge(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            _merge(config[key], value)
        else:
            config[key] = value
    return config


def start_gateway(
    name: str,
    log_dir: Path,
    *,
    engine: str = "vllm",
    engine_settings: EngineSettings | None = None,
    tls: bool = False,
    overrides: dict[str, Any] | None = None,
    cpus: set[int] | None = None,
    variant: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    ready_s: float = 240.0,
) -> Server:
    """The gateway (`python -m server`), or with `variant` switches of `bench.gateway_variant`
    (`--no-metrics`, `--gc-log FILE`, `--gc-freeze`). `env`: the engine environment, when not
    the engine settings' default."""
    config = gateway_config(engine, engine_settings, tls, overrides or {})
    log_dir.mkdir(parents=True, exist_ok=True)
    config_path = log_dir / f"{name}.config.json"
    config_path.write_text(json.dumps(config, indent=2))
    if env is None:
        env = engine_settings.env() if engine_settings else dict(ENGINE_ENV)
    launcher = ["-m", "bench.gateway_variant", *variant] if variant else ["-m", "server"]
    argv = [PY, *launcher, "--config", str(config_path)]
    process, log_path = _spawn(name, "gateway", argv, env, log_dir, cpus)
    server = _gateway(name, process, log_path, config["ServerConfig"], tls, tls_all=False)
    server.extra = {"config": config, "argv": argv}
    wait_ready(server, "/health", ready_s)
    return server


def _gateway(
    name: str,
    process: subprocess.Popen[bytes],
    log_path: Path,
    ports: dict[str, Any],
    tls: bool,
    *,
    tls_all: bool,
) -> Server:
    """A started gateway's Server; `tls_all`: management and metrics on HTTPS as well."""

    def url(key: str, secure: bool) -> str:
        return f"{'https' if secure else 'http'}://127.0.0.1:{ports[key]}"

    return Server(
        name=name,
        kind="gateway",
        process=process,
        url=url("port", tls),
        log_path=log_path,
        management_url=url("managementPort", tls and tls_all),
        metrics_url=url("metricsPort", tls and tls_all),
        tls=tls_client_context() if tls else None,
    )


SHIPPED_CONFIG = ROOT / "config.json"
_SHIPPED_PORTS = ("port", "managementPort", "metricsPort", "grpcPort")


def shipped_engine(path: Path = SHIPPED_CONFIG) -> EngineSettings:
    """The engine flags the shipped config.json gives the gateway, for vLLM's arm: its
    ModelConfig/LoraConfig where set, the gateway's defaults (seed 0, eager) otherwise, and no
    max_num_batched_tokens (both launchers then take vLLM's default for an API server)."""
    config = json.loads(path.read_text())
    model, lora = config["ModelConfig"], config["LoraConfig"]
    return EngineSettings(
        model=str(ROOT / model["modelWeightPath"]),
        served_name=model["modelName"],
        dtype=model["dtype"],
        max_model_len=model["maxModelLen"],
        max_num_seqs=model["maxNumSeqs"],
        max_num_batched_tokens=None,
        kv_cache_gib=model["kvCacheSpaceGiB"],
        enable_lora=lora["enabled"],
        max_loras=lora["maxLoras"],
        max_lora_rank=lora["maxLoraRank"],
        max_cpu_loras=lora["maxCpuLoras"],
        adapter_dir=str(ROOT / lora["adapterDir"]),
    )


def start_shipped_gateway(
    name: str, log_dir: Path, *, env: dict[str, str] | None = None, ready_s: float = 240.0
) -> Server:
    """The gateway from the shipped config.json as it is (HTTPS with mutual TLS on every
    listener, the tool-call parser, its limits), only its four ports moved to free ones through
    the environment (`GATEWAY__SERVERCONFIG__PORT`, ..., as a container sets them), so that a
    `make serve` on the fixed ports does not collide. `env`: more `GATEWAY__...` overrides (the
    bench's one-difference-at-a-time arms)."""
    ports = {key: free_port() for key in _SHIPPED_PORTS}
    overrides = {f"GATEWAY__SERVERCONFIG__{key.upper()}": str(v) for key, v in ports.items()}
    overrides.update(env or {})
    argv = [PY, "-m", "server", "--config", str(SHIPPED_CONFIG)]
    engine = shipped_engine()
    process, log_path = _spawn(name, "gateway", argv, {**engine.env(), **overrides}, log_dir, None)
    tls = overrides.get("GATEWAY__SERVERCONFIG__HTTPSENABLED", "true").lower() != "false"
    server = _gateway(name, process, log_path, ports, tls, tls_all=True)
    config = json.loads(SHIPPED_CONFIG.read_text())
    server.extra = {"config": config, "argv": argv, "env": overrides}
    wait_ready(server, "/health", ready_s)
    return server


def vllm_command(engine_settings: EngineSettings, port: int, api_servers: int = 1) -> list[str]:
    """vLLM's own OpenAI server on `engine_settings`. One API server: the
    `vllm.entrypoints.openai.api_server` module (scenario A). More: the `serve` subcommand with
    `--api-server-count` (through bench/vllm_serve.py), the only launcher that starts them; the
    module accepts the flag but always runs one API server in-process."""
    launcher = ["-m", "vllm.entrypoints.openai.api_server"]
    if api_servers > 1:
        launcher = ["-m", "bench.vllm_serve", "--api-server-count", str(api_servers)]
    return [
        PY, *launcher, *engine_settings.vllm_args(),
        "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
    ]  # fmt: skip


def start_vllm(
    name: str,
    log_dir: Path,
    engine_settings: EngineSettings,
    cpus: set[int] | None = None,
    *,
    api_servers: int = 1,
    env: dict[str, str] | None = None,
) -> Server:
    port = free_port()
    argv = vllm_command(engine_settings, port, api_servers)
    env = engine_settings.env() if env is None else env
    process, log_path = _spawn(name, "vllm", argv, env, log_dir, cpus)
    server = Server(
        name=name,
        kind="vllm",
        process=process,
        url=f"http://127.0.0.1:{port}",
        log_path=log_path,
        extra={"argv": argv},
    )
    wait_ready(server, "/v1/models")
    return server


def start_bare(
    name: str,
    log_dir: Path,
    capture: Path,
    *,
    tls: bool = False,
    cpus: set[int] | None = None,
    granian: bool = False,
) -> Server:
    port = free_port()
    argv = [PY, "-m", "bench.bare", "--capture", str(capture), "--port", str(port)]
    if tls:
        argv.append("--tls")
    if granian:
        argv.append("--granian")
    process, log_path = _spawn(name, "bare", argv, dict(ENGINE_ENV), log_dir, cpus)
    server = Server(
        name=name,
        kind="bare",
        process=process,
        url=f"{'https' if tls else 'http'}://127.0.0.1:{port}",
        log_path=log_path,
        tls=tls_client_context() if tls else None,
        extra={"argv": argv},
    )
    wait_ready(server, "/health")
    return server


_ENGINE_LINES = (
    re.compile(r"Initializing a V1 LLM engine.*with config: (.*)$"),
    re.compile(r"(max_num_batched_tokens=\d+.*)$"),
)


def engine_config_line(log_text: str) -> str | None:
    """The engine-config line vLLM's engine core logs at start (the last one in the log)."""
    found = None
    for line in log_text.splitlines():
        match = _ENGINE_LINES[0].search(line)
        if match:
            found = match.group(1).strip()
    return found


def comparable_engine_config(line: str | None) -> str | None:
    """The engine config without fields that name the launcher (kept for the diff)."""
    if line is None:
        return None
    return re.sub(r"served_model_name=[^,]*, ", "", line)
