"""The built image, run for real (`make test-image`, after `make image`; not part of `make test`).

The image built by deploy/image/build.sh runs under `buildah run` (chroot isolation, host
network, no daemon) with exactly the mounts the Dockerfile's header names: the dev certificates
at /certs, the demo model at /models and deploy/config.json at /etc/llm-gateway/config.json. Only
the ports (free ones) and the listen address (loopback) are overridden, through the environment
as an operator would. The README's curl must answer over mutual TLS, the image's own HEALTHCHECK
command must report healthy, and SIGTERM to the container's main process must drain and exit 0.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serverproc import CERTS, DEMO, ROOT, ensure_assets, free_port, readme_curl

TAG = os.environ.get("IMAGE_TAG", "localhost/llm-gateway:latest")
START_TIMEOUT = 900.0  # a cold engine start on 2 shared cores, inside a fresh container
# The first test also pays for the fixture: copying the image into a vfs container (minutes on
# a busy disk) and starting the engine.
pytestmark = pytest.mark.timeout(1800)
# What the gateway needs from /certs (deploy/config.json's names) and the probe's client pair.
MOUNTED_CERTS = ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")


def buildah(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buildah", *args], capture_output=True, text=True, check=check)


def missing(reason: str) -> None:
    """Skip, or fail under `make test-image` (IMAGE_REQUIRED=1), which must not pass green
    without having run the image."""
    if os.environ.get("IMAGE_REQUIRED") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def image_config() -> dict[str, Any]:
    """The built image's Docker config (Entrypoint, Cmd, User, Env, Healthcheck), or a skip."""
    if shutil.which("buildah") is None:
        missing("buildah is not installed: `make image` installs it and builds the image")
    if os.geteuid() != 0:
        missing("running the image without a daemon needs root (buildah, chroot isolation)")
    found = buildah("inspect", "--type", "image", TAG, check=False)
    if found.returncode != 0:
        missing(f"image {TAG} not built: run `make image` first")
    config: dict[str, Any] = json.loads(found.stdout)["Docker"]["config"]
    return config


def mounted_certs(folder: Path, user: str) -> Path:
    """The dev certificates as an operator mounts them: readable by the image's user only."""
    uid, _, gid = user.partition(":")
    folder.mkdir()
    for name in MOUNTED_CERTS:
        target = folder / name
        shutil.copyfile(CERTS / name, target)
        target.chmod(0o400)
        os.chown(target, int(uid), int(gid or uid))
    return folder


@dataclass
class Container:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    config: dict[str, Any]
    run_options: list[str]
    ports: dict[str, int]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def run(self, command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        """`docker exec` for a chroot container: one more `buildah run` with the same mounts."""
        options = [*self.run_options, *(f"--env={k}={v}" for k, v in env.items())]
        return buildah("run", *options, self.name, "--", "/bin/sh", "-c", command, check=False)

    def main_pid(self) -> int:
        """The image's ENTRYPOINT process: under chroot isolation, the child of buildah's
        `buildah-chroot-exec` below our `buildah run` (what `docker stop` signals as PID 1)."""
        for pid in descendants(self.process.pid):
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if command_line(parent)[:1] == ["buildah-chroot-exec"]:
                return pid
        raise AssertionError(f"no container process below buildah run {self.process.pid}")


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return []


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def mtls_context() -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(CERTS / "ca.pem"))
    context.load_cert_chain(str(CERTS / "client.pem"), str(CERTS / "client.key"))
    return context


def wait_ready(container: Container) -> None:
    url = f"https://127.0.0.1:{container.ports['MANAGEMENT_PORT']}/v2/health/ready"
    deadline = time.monotonic() + START_TIMEOUT
    with httpx.Client(verify=mtls_context(), timeout=5) as client:
        while time.monotonic() < deadline:
            if container.process.poll() is not None:
                raise AssertionError(f"the container exited with {container.process.returncode}:"
                                     f"\n{container.log()[-4000:]}")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
    raise AssertionError(f"not ready after {START_TIMEOUT}s:\n{container.log()[-4000:]}")


def stop(container: Container) -> None:
    if container.process.poll() is None:
        for pid in descendants(container.process.pid):
            os.kill(pid, signal.SIGKILL)
        container.process.kill()
        container.process.wait(30)


@pytest.fixture(scope="module")
def container(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    config = image_config()
    ensure_assets()
    folder = tmp_path_factory.mktemp("image")
    name = f"llm-gateway-test-{uuid.uuid4().hex[:8]}"
    buildah("from", "--pull=false", "--name", name, TAG)
    ports = {"PORT": free_port(), "MANAGEMENTPORT": free_port(), "METRICSPORT": free_port()}
    run_options = [
        "--isolation=chroot",
        "--network=host",
        f"--volume={mounted_certs(folder / 'certs', config['User'])}:/certs:ro",
        f"--volume={DEMO.resolve()}:/models:ro",
        f"--volume={ROOT / 'deploy' / 'config.json'}:/etc/llm-gateway/config.json:ro",
        "--env=GATEWAY__SERVERCONFIG__IPADDRESS=127.0.0.1",
        *(f"--env=GATEWAY__SERVERCONFIG__{key}={port}" for key, port in ports.items()),
        f"--env=MANAGEMENT_PORT={ports['MANAGEMENTPORT']}",  # what the HEALTHCHECK dials
    ]
    log_path = folder / "container.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            ["buildah", "run", *run_options, name, "--", *config["Entrypoint"], *config["Cmd"]],
            stdout=log, stderr=subprocess.STDOUT,
        )
    running = Container(name, process, log_path, config, run_options,
                        {**ports, "MANAGEMENT_PORT": ports["MANAGEMENTPORT"]})
    try:
        wait_ready(running)
        yield running
    finally:
        stop(running)
        buildah("rm", name, check=False)


def healthcheck(config: dict[str, Any]) -> str:
    """The image's HEALTHCHECK command (a `docker` format image keeps it; OCI drops it)."""
    test = config["Healthcheck"]["Test"]
    assert test[0] == "CMD-SHELL", test
    return str(test[1])


def test_the_image_runs_what_the_dockerfile_says() -> None:
    """The fixture runs ENTRYPOINT + CMD as built, as this user, and the HEALTHCHECK as built."""
    config = image_config()
    assert config["Entrypoint"] == ["llm-gateway"]
    assert config["Cmd"] == ["--config", "/etc/llm-gateway/config.json"]
    assert config["User"] == "10001:10001"
    assert config["StopSignal"] == "SIGTERM"
    assert shlex.split(healthcheck(config))[:3] == ["python", "-m", "server.dev.healthcheck"]


def test_the_readme_curl_answers_over_mtls(container: Container) -> None:
    done = subprocess.run(readme_curl(container.ports["PORT"]), cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    answer = json.loads(done.stdout)
    assert answer["object"] == "chat.completion", done.stdout
    assert answer["model"] == "a1"
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] > 0


def test_the_same_curl_without_a_client_certificate_is_refused(container: Container) -> None:
    command = readme_curl(container.ports["PORT"])
    for flag in ("--cert", "--key"):
        del command[command.index(flag):command.index(flag) + 2]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode != 0
    assert done.stdout == ""


def test_the_healthcheck_reports_healthy(container: Container) -> None:
    port = str(container.ports["MANAGEMENT_PORT"])
    probe = container.run(healthcheck(container.config), {"MANAGEMENT_PORT": port})
    assert probe.returncode == 0, probe.stderr


def test_the_healthcheck_reports_a_dead_listener(container: Container) -> None:
    probe = container.run(healthcheck(container.config), {"MANAGEMENT_PORT": str(free_port())})
    assert probe.returncode == 1
    assert "healthcheck: https://127.0.0.1:" in probe.stderr


def test_sigterm_drains_an_inflight_stream_and_exits_0(container: Container) -> None:
    url = f"https://127.0.0.1:{container.ports['PORT']}/v1/completions"
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    events = []
    with (httpx.Client(verify=mtls_context(), timeout=120) as client,
          client.stream("POST", url, json=body) as stream):
        lines = stream.iter_lines()
        events.append(next(line for line in lines if line.startswith("data:")))
        os.kill(container.main_pid(), signal.SIGTERM)
        events += [line for line in lines if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    finishes = [json.loads(e[5:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] == "length"
    assert container.process.wait(120) == 0, container.log()[-4000:]
    log = container.log()
    assert "SIGTERM: draining" in log
    assert "drain ended before idle" not in log


