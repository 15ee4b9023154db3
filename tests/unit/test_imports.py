"""Importing the project must not load vLLM or torch, read the environment or start anything."""

from __future__ import annotations

import subprocess
import sys


def test_import_server_and_protocols_does_not_load_vllm() -> None:
    code = (
        "import sys, server, protocols, server.gateway, server.runtime, server.cli, "
        "server.engine.vllm_engine, server.demo_model\n"
        "loaded = [m for m in ('vllm', 'torch', 'transformers') if m in sys.modules]\n"
        "print(','.join(loaded))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={}
    )
    assert result.stdout.strip() == ""
