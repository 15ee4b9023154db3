"""Importing the project must not load vLLM or torch, read the environment or start anything."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_import_server_and_protocols_does_not_load_vllm() -> None:
    code = (
        "import sys, server, protocols, server.gateway, server.runtime.process, server.cli, "
        "server.engines.vllm, server.engines.factory, server.dev.demo_model\n"
        "loaded = [m for m in ('vllm', 'torch', 'transformers') if m in sys.modules]\n"
        "print(','.join(loaded))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={}
    )
    assert result.stdout.strip() == ""


def test_the_unit_tier_cannot_import_the_engine_stack(request: pytest.FixtureRequest) -> None:
    """Under `make test` the unit tier runs with tests/unit/isolation.py (torch, vllm and
    transformers unimportable); this proves the block is in force there."""
    if not request.config.pluginmanager.has_plugin("tests.unit.isolation"):
        pytest.skip("run without tests.unit.isolation (make unit / make test load it)")
    for name in ("torch", "vllm", "transformers"):
        with pytest.raises(ImportError, match="not importable in the unit tier"):
            __import__(name)
