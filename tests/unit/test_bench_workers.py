"""The benchmark's scenario W: vLLM's multi-API-server command line, the engine environment
without runtime LoRA updates, server processes told apart by role."""

from __future__ import annotations

import pytest

from bench.record import process_role
from bench.servers import EngineSettings, vllm_command


def test_one_api_server_is_the_openai_module_and_more_go_through_vllm_serve() -> None:
    engine = EngineSettings()
    one = vllm_command(engine, 8000)
    two = vllm_command(engine, 8000, api_servers=2)
    assert one[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--api-server-count" not in one
    assert two[1:5] == ["-m", "bench.vllm_serve", "--api-server-count", "2"]
    # the same engine flags (adapters given at start included) and listener on both
    assert one[3:] == two[5:]
    assert "--lora-modules" in two
    assert two[-5:] == ["--host", "127.0.0.1", "--port", "8000", "--disable-uvicorn-access-log"]


def test_the_environment_without_runtime_lora_updates_differs_in_that_variable_only() -> None:
    engine = EngineSettings()
    usual = engine.env()
    without = engine.env(runtime_lora_updates=False)
    assert usual["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in without
    assert {k: v for k, v in usual.items() if k != "VLLM_ALLOW_RUNTIME_LORA_UPDATING"} == without


@pytest.mark.parametrize(
    ("comm", "cmdline", "role"),
    [
        ("VLLM::EngineCor", "VLLM::EngineCore", "engine"),
        ("VLLM::Worker", "VLLM::Worker", "engine"),
        ("VLLM::DPCoordin", "VLLM::DPCoordinator", "engine"),
        ("VLLM::APIServer", "VLLM::APIServer_1", "front"),
        ("python", "python -m server --config c.json", "front"),
        ("python", "python -B -c from multiprocessing.spawn import spawn_main; spawn_main()",
         "front"),
        ("python", "python -B -c from multiprocessing.resource_tracker import main;main(8)",
         "helper"),
    ],
)  # fmt: skip
def test_server_processes_are_told_apart_by_name(comm: str, cmdline: str, role: str) -> None:
    assert process_role(comm, cmdline) == role
