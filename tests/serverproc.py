"""Start the gateway as a real process on loopback, wait until ready, stop it cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.servers import free_port
from server.core.lifecycle import PHASES

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "build" / "demo"
CERTS = ROOT / "certs"




def readme_curl(port: int) -> list[str]:
    """The README's first curl example (mutual TLS, run from the repository's root), pointed at
    `port` instead of the shipped data port 1025."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("```bash\ncurl -s --cacert") + len("```bash\n"):]
    command = block[: block.index("```")].replace("\\\n", " ")
    return shlex.split(command.replace("localhost:1025", f"localhost:{port}"))


def ensure_assets() -> None:
    """Build the demo model and dev certificates if absent (cached after the first run)."""
    from certs.generate import generate
    from server.dev.demo_model import build_demo

    build_demo(DEMO)
    generate(CERTS)


@dataclass
class RunningServer:
    process: subprocess.Popen[bytes]
    config: dict[str, Any]
    log_path: Path
    data_port: int
    management_port: int
    metrics_port: int

    @property
    def url(self) -> str:
        scheme = "https" if self.config["ServerConfig"].get("httpsEnabled") else "http"
        return f"{scheme}://127.0.0.1:{self.data_port}"

    @property
    def management_url(self) -> str:
        scheme = "https" if self.config["ServerConfig"].get("managementHttpsEnabled") else "http"
        return f"{scheme}://127.0.0.1:{self.management_port}"

    @property
    def grpc_address(self) -> str:
        """host:port of the gRPC listener (plaintext unless the test's config says otherwise)."""
        return f"127.0.0.1:{self.config['ServerConfig']['grpcPort']}"

    @property
    def metrics_url(self) -> str:
        scheme = "https" if self.config["ServerConfig"].get("metricsHttpsEnabled") else "http"
        return f"{scheme}://127.0.0.1:{self.metrics_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def base_config(engine: str = "vllm") -> dict[str, Any]:
    """A config for tests: plain HTTP data and metrics listeners, mTLS management listener."""
    data, management, metrics = free_port(), free_port(), free_port()
    return {
        "engine": engine,
        "ServerConfig": {
            "ipAddress": "127.0.0.1",
            "port": data,
            "managementPort": management,
            "metricsPort": metrics,
            "grpcPort": free_port(),
            "httpsEnabled": False,
            "managementHttpsEnabled": True,
            "grpcHttpsEnabled": False,
            "tlsCaPath": str(CERTS),
            "tlsCaFile": ["ca.pem"],
            "tlsCert": str(CERTS / "server.pem"),
            "tlsPk": str(CERTS / "server.key"),
            "tlsCrlPath": str(CERTS),
            "tlsCrlFiles": ["crl.pem"],
            "maxRequestLength": 1,
            # `make test` runs the conformance suite once more on two worker processes
            "workers": int(os.environ.get("GATEWAY_TEST_WORKERS", "1")),
            # no lame-duck period: a stop refuses new requests at once (tests of drainDelay and
            # of a balancer in front set it)
            "drainDelay": 0,
        },
        "ModelConfig": {
            "modelName": "tiny",
            "modelWeightPath": str(DEMO / "model"),
            "maxModelLen": 512,
            "maxNumSeqs": 32,
            "toolCallParser": "hermes",
        },
        "LoraConfig": {
            "enabled": True,
            "maxLoras": 2,
            "maxLoraRank": 8,
            "maxCpuLoras": 4,
            "adapterDir": str(DEMO / "adapters"),
            "adapterRoots": [str(DEMO)],
        },
        "LimitsConfig": {"maxConcurrentRequests": 64, "maxQueue": 128, "drainTimeout": 20},
    }


DEMO_WORKFLOW = "tiny-a2"  # a DJL workflow endpoint: the base model with adapter a2


def demo_workflow(folder: Path) -> Path:
    """Write DJL's adapter workflow.json (base model + a2) into `folder`; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "workflow.json"
    path.write_text(json.dumps({
        "name": DEMO_WORKFLOW, "version": "0.1",
        "models": {"m": str(DEMO / "model")},
        "configs": {"adapters": {"a2": {"model": "m", "src": str(DEMO / "adapters" / "a2")}}},
        "workflow": {"out": ["adapter", "a2", "in"]},
    }, indent=2))
    return path


def merge(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            merge(config[key], value)
        else:
            config[key] = value
    return config


@contextlib.contextmanager
def running_server(
    tmp_dir: Path,
    *,
    engine: str = "vllm",
    overrides: dict[str, Any] | None = None,
    ready_timeout: float = 180.0,
    client_tls: ssl.SSLContext | None = None,  # to probe an https data listener
    environ: dict[str, str] | None = None,  # more environment, e.g. DJL's OPTION_* keys
) -> Iterator[RunningServer]:
    ensure_assets()
    config = merge(base_config(engine), overrides or {})
    server = start_server(tmp_dir, config, environ)
    try:
        wait_ready(server, ready_timeout, client_tls)
        yield server
    finally:
        server.stop()


def start_server(
    tmp_dir: Path, config: dict[str, Any], environ: dict[str, str] | None = None
) -> RunningServer:
    """Write `config` into `tmp_dir` and start the gateway on it (not waiting for READY); the
    log goes to tmp_dir/server.log, replaced on each start."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    config_path = tmp_dir / "config.json"
    config_path.write_text(json.dumps(config, indent=2))
    log_path = tmp_dir / "server.log"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "PYTHONUNBUFFERED": "1",
        **(environ or {}),
    }
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "--config", str(config_path)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return RunningServer(
        process=process,
        config=config,
        log_path=log_path,
        data_port=config["ServerConfig"]["port"],
        management_port=config["ServerConfig"]["managementPort"],
        metrics_port=config["ServerConfig"]["metricsPort"],
    )


def start_up_problems(log: str) -> list[str]:
    """What is wrong with a real gateway's start-up log: each phase must be logged once, no
    uvicorn line once per listener, the settings one key per line, no gateway line twice."""
    problems = [f"phase {p!r} logged {log.count(f'start-up {p}: ')} times"
                for p in PHASES if log.count(f"start-up {p}: ") != 1]
    if "Uvicorn running on" in log or "Started server process" in log:
        problems.append("uvicorn's per-listener lines are back")
    ports = re.findall(r"setting ServerConfig\.port = \d+ \(config\.json\)\n", log)
    if len(ports) != 1 or "settings: {" in log:
        problems.append("settings are not one key per line")
    ours = [line.split(" [-] ", 1)[-1] for line in log.splitlines() if " INFO gateway " in line]
    repeated = {line for line in ours if ours.count(line) > 1}
    return problems + [f"logged more than once: {line}" for line in sorted(repeated)]


def wait_ready(
    server: RunningServer, timeout: float, client_tls: ssl.SSLContext | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"server exited with {server.process.returncode}:\n{server.log()[-4000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{server.url}/health", timeout=2, verify=client_tls or True)
            if response.status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout}s:\n{server.log()[-4000:]}")
