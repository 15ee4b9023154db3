"""KServe's own Python SDK (`kserve.InferenceRESTClient`, Open Inference Protocol v2) against the
live server: server live and ready, model ready. The `kserve` package pins protobuf and psutil
below what vLLM runs with, so it lives in its own virtual environment (build/kserve-venv, made
on first use from PyPI; the test is skipped with the reason when it cannot be made)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.serverproc import ROOT, RunningServer

pytestmark = pytest.mark.server

VENV = ROOT / "build" / "kserve-venv"
SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    from kserve import InferenceRESTClient, RESTConfig

    async def main(url, model):
        client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
        try:
            return {
                "live": await client.is_server_live(url),
                "ready": await client.is_server_ready(url),
                "model_ready": await client.is_model_ready(url, model),
            }
        finally:
            await client.close()

    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
""")


def kserve_python() -> Path:
    python = VENV / "bin" / "python"
    if python.exists() and _imports_kserve(python):
        return python
    try:
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=120)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "kserve"], check=True,
                       timeout=900, capture_output=True)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"KServe's SDK could not be installed in its own venv: {exc}")
    return python


def _imports_kserve(python: Path) -> bool:
    done = subprocess.run([str(python), "-c", "import kserve"], capture_output=True, timeout=120)
    return done.returncode == 0


def test_kserve_sdk_reads_server_and_model_health(live_server: RunningServer) -> None:
    python = kserve_python()
    done = subprocess.run(
        [str(python), "-c", SCRIPT, live_server.url, "tiny"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "live": True, "ready": True, "model_ready": True,
    }
