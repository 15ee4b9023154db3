"""The benchmark's scenario W: vLLM's multi-API-server command line, the engine environment
without runtime LoRA updates, server processes told apart by role, and the report's figures
(the scaling factor split into cores and work per core, the busiest worker, rounds paired)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.record import process_role
from bench.report import Results, busiest_share, scaling_terms, w_section, wb_figures
from bench.servers import SHIPPED_CONFIG, EngineSettings, shipped_engine, vllm_command


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


def test_scenario_as_gives_vllm_the_engine_flags_of_the_shipped_config() -> None:
    model = json.loads(SHIPPED_CONFIG.read_text())["ModelConfig"]
    argv = vllm_command(shipped_engine(), 8000)
    assert argv[argv.index("--max-num-seqs") + 1] == str(model["maxNumSeqs"])
    assert "--max-num-batched-tokens" not in argv  # unset in config.json: vLLM's default on both
    assert shipped_engine().gateway_sections()["ModelConfig"]["engineOptions"] == {}


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


def test_the_factor_is_the_cores_term_times_the_per_core_term() -> None:
    terms = scaling_terms(1000.0, 1.0, 1500.0, 1.8)
    assert terms is not None
    assert terms["factor"] == pytest.approx(1.5)
    assert terms["cores"] == pytest.approx(1.8)
    assert terms["per_core"] == pytest.approx(1.5 / 1.8)
    assert terms["cores"] * terms["per_core"] == pytest.approx(terms["factor"])
    assert scaling_terms(None, 1.0, 1500.0, 1.8) is None
    assert scaling_terms(1000.0, 0.0, 1500.0, 1.8) is None


def _process(cpu_s: float, role: str = "front", root: bool = False) -> dict[str, Any]:
    return {"pid": 1, "role": role, "comm": "python", "root": root, "cpu_s": cpu_s}


def test_the_busiest_worker_leaves_out_the_supervisor_the_engine_and_helpers() -> None:
    processes = [
        _process(0.01, root=True), _process(0.0, "helper"), _process(3.0, "engine"),
        _process(0.6), _process(0.4),
    ]  # fmt: skip
    assert busiest_share(processes) == pytest.approx(0.6)
    assert busiest_share([_process(0.9, root=True)]) is None
    assert busiest_share(None) is None


def _wb_window(
    ident: int, arm: str, rnd: int, rate: float, cores: float, **extra: Any
) -> dict[str, Any]:
    processes = [_process(0.0, root=True)]
    processes += [_process(cores / 2), _process(cores / 2)] if arm == "workers2" else []
    return {
        "id": ident, "scenario": "WB", "arm": arm, "label": "openai-chat-whole",
        "session": f"WB-{arm}-r{rnd}", "tags": {"round": rnd},
        "workload": {"stream": False, "duration_s": 2, "warmup_s": 1, "concurrency": 32},
        "duration_s": 2.0, "server_cpu_share": cores, "server_cpu_s": 2 * cores,
        "client_cpu_share": 0.2, "machine_busy_s": 3.8, "engine_cpu_s": 0.0,
        "others_cpu_share": extra.pop("others", 0.1), "server_processes": processes,
        "summary": {"req_per_s": rate, "completed": int(2 * rate), "flagged": False, **extra},
    }  # fmt: skip


def _run(tmp_path: Path, windows: list[dict[str, Any]]) -> Results:
    meta = {
        "run": "t", "started": "now", "commit": "0" * 40,
        "machine": {"cores": 2, "loadavg_at_start": [0.0, 0.0, 0.0]}, "settings": {},
    }  # fmt: skip
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "windows.jsonl").write_text("".join(json.dumps(w) + "\n" for w in windows))
    return Results(tmp_path)


def test_rounds_are_paired_and_a_flagged_run_leaves_its_round_out(tmp_path: Path) -> None:
    windows = [
        _wb_window(0, "workers1", 0, 10_000.0, 1.0),
        _wb_window(1, "workers2", 0, 12_000.0, 1.6),
        _wb_window(2, "workers2", 1, 16_000.0, 1.8),  # the second arm goes first in round 1
        _wb_window(3, "workers1", 1, 10_000.0, 1.0, others=0.5),
        _wb_window(4, "workers1", 2, 9_000.0, 1.0),
        _wb_window(5, "workers2", 2, 99_000.0, 1.8, flagged=True),
    ]
    figures = wb_figures(_run(tmp_path, windows))
    assert figures["arms"] == ("workers1", "workers2")
    entry = figures["routes"]["openai-chat-whole"]
    assert entry["rounds"] == 2
    assert entry["factor"] == pytest.approx((1.2 + 1.6) / 2)
    assert entry["factor_spread"] == pytest.approx((1.2, 1.6))
    assert entry["cores"] == pytest.approx((1.6 + 1.8) / 2)
    assert entry["quiet_rounds"] == 1  # round 1's workers-1 window was disturbed
    assert entry["quiet_factor"] == pytest.approx(1.2)
    assert len(entry["flagged"]) == 1
    assert entry["workers1"]["cost_us"] == pytest.approx(100.0)  # 1 core / 10,000 req/s
    assert entry["workers2"]["busiest"] == pytest.approx(0.5)
    assert [r["round"] for r in entry["per_round"]] == [0, 1]
    assert entry["balanced_rounds"] == 2


def test_a_window_where_one_worker_did_everything_is_called_so(tmp_path: Path) -> None:
    lopsided = _wb_window(1, "workers2", 0, 10_000.0, 1.0)
    lopsided["server_processes"][1]["cpu_s"] = 2.0  # all of it
    lopsided["server_processes"][2]["cpu_s"] = 0.0
    windows = [_wb_window(0, "workers1", 0, 10_000.0, 1.0), lopsided]
    figures = wb_figures(_run(tmp_path, windows))
    entry = figures["routes"]["openai-chat-whole"]
    assert entry["per_round"][0]["busiest"] == pytest.approx(1.0)
    assert entry["balanced_rounds"] == 0
    text = w_section(_run(tmp_path, windows))
    assert "One worker took all the connections in 1 of 1 windows" in text
    assert "no window here had both workers serving" in text


def test_the_section_is_absent_without_w_windows_and_says_what_is_extrapolation(
    tmp_path: Path,
) -> None:
    assert w_section(_run(tmp_path, [])) == ""
    windows = [
        _wb_window(0, "workers1", 0, 10_000.0, 1.0),
        _wb_window(1, "workers2", 0, 15_000.0, 1.7),
    ]
    text = w_section(_run(tmp_path, windows))
    assert "### W-B." in text and "### W-A." not in text
    assert "**1.50**" in text
    assert "extrapolation" in text and "not measured" in text
    assert "≈ 10,000 requests/s per front-end core" in text
