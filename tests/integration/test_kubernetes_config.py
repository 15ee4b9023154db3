"""The rendered Kubernetes manifests served for real: the gateway starts on the REAL engine with
exactly the config.json of the rendered ConfigMap (only the mounted paths, /certs and /models,
pointed at this checkout's certificates and demo model, as the volumes would mount them), with
HOME and TMPDIR on scratch directories as the pod's emptyDirs give them. The kubelet's part is
played by the test: the startup probe is repeated as rendered (period x failureThreshold), then
the readiness and liveness probes, exactly the rendered paths, ports and schemes; the preStop
command is run as rendered and drains the server, which exits 0.

The config's fixed ports and 0.0.0.0 address are the pod's own network: the server runs in a
network namespace made for it here (`unshare --net`, only a loopback inside), and every probe and
request enters that namespace (`nsenter`), so nothing listens on the host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.kube import config_json, container, one, port_number
from tests.serverproc import CERTS, DEMO, ROOT, ensure_assets

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
STOP_S = 120.0


def mounted(config: dict[str, Any]) -> dict[str, Any]:
    """The config as the pod sees it, its /certs and /models at this checkout's files."""
    text = json.dumps(config)
    text = text.replace('"/certs/', json.dumps(f"{CERTS}/")[:-1])
    text = text.replace('"/models/', json.dumps(f"{DEMO}/")[:-1])
    text = text.replace('"/models"', json.dumps(str(DEMO)))
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def mounted_argv(argv: list[str]) -> list[str]:
    return [arg.replace("/certs/", f"{CERTS}/") for arg in argv]


class Pod:
    """The server in its own network namespace, and commands run inside it."""

    def __init__(self, tmp: Path, config: dict[str, Any]) -> None:
        path = tmp / "config.json"
        path.write_text(json.dumps(config, indent=2))
        home, scratch = tmp / "home", tmp / "tmp"
        home.mkdir()
        scratch.mkdir()
        env = {**os.environ, "HOME": str(home), "TMPDIR": str(scratch),
               "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1"}
        self.log = tmp / "server.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                ["unshare", "--net", "--", "sh", "-c",
                 'ip link set lo up && exec "$0" -m server --config "$1"',
                 sys.executable, str(path)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            )

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["nsenter", f"--target={self.process.pid}", "--net", "--", *argv],
            cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
        )

    def probe(self, probe: dict[str, Any], port: int) -> bool:
        """One kubelet httpGet probe: success is an answer in 200..399 within timeoutSeconds
        (the healthcheck module asks for 200, which is what these routes answer when well)."""
        get = probe["httpGet"]
        url = f"{get['scheme'].lower()}://127.0.0.1:{port}{get['path']}"
        timeout = float(probe.get("timeoutSeconds", 1))
        done = self.run([sys.executable, "-m", "server.dev.healthcheck", "--url", url,
                         "--timeout", str(timeout)], timeout + 30)
        return done.returncode == 0

    def python(self, code: str) -> str:
        done = self.run([sys.executable, "-c", code], 120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


def wait_started(pod: Pod, probe: dict[str, Any], port: int) -> None:
    """The startup probe as the kubelet runs it: every periodSeconds, failureThreshold times."""
    for _ in range(probe["failureThreshold"]):
        assert pod.process.poll() is None, pod.log.read_text()[-3000:]
        if pod.probe(probe, port):
            return
        time.sleep(probe["periodSeconds"])
    raise AssertionError("the startup probe never passed:\n" + pod.log.read_text()[-3000:])


def test_the_rendered_config_serves_and_answers_the_rendered_probes(tmp_path: Path) -> None:
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")):
        pytest.skip("a network namespace of its own needs root and util-linux's unshare/nsenter")
    ensure_assets()
    config = config_json()
    deployment = one("Deployment")
    gateway = container(deployment)
    pod = Pod(tmp_path, mounted(config))
    try:
        startup = gateway["startupProbe"]
        wait_started(pod, startup, port_number(gateway, startup["httpGet"]["port"]))
        for kind in ("readinessProbe", "livenessProbe"):
            probe = gateway[kind]
            assert pod.probe(probe, port_number(gateway, probe["httpGet"]["port"])), kind
        server = config["ServerConfig"]
        data, metrics = server["port"], server["metricsPort"]
        # the InferencePool's target port serves an adapter by its name in `model`
        (target,) = one("InferencePool")["spec"]["targetPorts"]
        assert target["number"] == data
        answer = pod.python(
            f"import httpx; r = httpx.post('http://127.0.0.1:{data}/v1/completions', "
            "timeout=120, json={'model': 'a1', 'prompt': 'hi', 'max_tokens': 4}); "
            "print(r.status_code, r.json()['model'])"
        )
        assert answer.split() == ["200", "a1"]
        scraped = pod.python(
            f"import httpx; print(httpx.get('http://127.0.0.1:{metrics}/metrics').text)"
        )
        assert "vllm:lora_requests_info{" in scraped
        assert "vllm:num_requests_waiting{" in scraped
        # Kubernetes runs preStop, then SIGTERM: the hook drains the server by itself
        command = gateway["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "python"
        hook = pod.run(mounted_argv([sys.executable, *command[1:]]),
                       deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
        assert hook.returncode == 0, hook.stderr
        assert pod.process.wait(STOP_S) == 0
    finally:
        pod.stop()
