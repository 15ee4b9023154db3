"""Scenario L's parts (bench/lora_mix.py): adapters with distinct weights, the metrics it reads,
the mixes and the summary table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from bench.lora_mix import distinct_adapters, medians, metric_total, mixes, table, window_row
from server.core.adapter_files import content_digest


def source_adapter(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    rng = np.random.default_rng(0)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": rng.standard_normal((2, 4), dtype=np.float32),
               f"{prefix}.lora_B.weight": rng.standard_normal((4, 2), dtype=np.float32)},
              str(folder / "adapter_model.safetensors"))
    return folder


def test_copies_have_their_own_lora_b_and_the_sources_shapes(tmp_path: Path) -> None:
    source = source_adapter(tmp_path / "a1")
    names = distinct_adapters(3, source, tmp_path / "mix")
    assert names == ["l00", "l01", "l02"]
    original = load_file(str(source / "adapter_model.safetensors"))
    copies = [load_file(str(tmp_path / "mix" / n / "adapter_model.safetensors")) for n in names]
    for copy in copies:
        assert {k: v.shape for k, v in copy.items()} == {k: v.shape for k, v in original.items()}
        a_key = next(k for k in copy if "lora_A" in k)
        assert np.array_equal(copy[a_key], original[a_key])
    b_key = next(k for k in original if "lora_B" in k)
    assert len({copy[b_key].tobytes() for copy in copies} | {original[b_key].tobytes()}) == 4
    assert len({content_digest(tmp_path / "mix" / n) for n in names}) == 3
    config = json.loads((tmp_path / "mix" / "l01" / "adapter_config.json").read_text())
    assert config["revision"] == "l01"
    assert not list((tmp_path / "mix").glob(".*"))  # no staging folder left


def test_existing_copies_are_kept(tmp_path: Path) -> None:
    source = source_adapter(tmp_path / "a1")
    distinct_adapters(2, source, tmp_path / "mix")
    weights = tmp_path / "mix" / "l00" / "adapter_model.safetensors"
    before = weights.stat().st_mtime_ns
    assert distinct_adapters(2, source, tmp_path / "mix") == ["l00", "l01"]
    assert weights.stat().st_mtime_ns == before


def test_metric_totals_add_every_series_of_one_name_only() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="tiny"} 12.0\n'
        'vllm:num_requests_running{engine="1",model_name="tiny"} 3.0\n'
        "vllm:num_requests_running_other 100.0\n"
        'vllm:lora_adapter_load_seconds_count{adapter_name="l00"} 2.0\n'
        "vllm:lora_adapter_load_seconds_count 1e+01\n"
    )
    assert metric_total(text, "vllm:num_requests_running") == 15.0
    assert metric_total(text, "vllm:lora_adapter_load_seconds_count") == 12.0
    assert metric_total(text, "vllm:num_requests_waiting") == 0.0


def test_mixes_start_with_the_base_model_then_the_first_k_adapters() -> None:
    names = [f"l{i:02d}" for i in range(8)]
    assert mixes(names, (2, 8)) == [
        ("base", ("tiny",)), ("2-adapters", ("l00", "l01")), ("8-adapters", tuple(names)),
    ]


def test_table_gives_each_mix_its_arms_base_rate_share() -> None:
    def row(arm: str, label: str, rate: float, loads: float | None) -> dict[str, object]:
        return {"arm": arm, "label": label, "round": 0, "req_per_s": rate, "ttft_p50_ms": 10.0,
                "ttft_p99_ms": 20.0, "running_mean": 8.0, "running_max": 16.0,
                "loads_per_request": loads}

    text = table([row("gateway", "base", 100.0, 0.0), row("gateway", "2-adapters", 95.0, 0.0),
                  row("vllm", "base", 80.0, None), row("vllm", "2-adapters", 40.0, None)])
    lines = {tuple(line.split()[:2]): line.split() for line in text.splitlines()[1:]}
    assert lines[("gateway", "2-adapters")][3] == "0.95"
    assert lines[("vllm", "2-adapters")][3] == "0.50"
    assert lines[("vllm", "2-adapters")][-1] == "-"
    assert lines[("gateway", "2-adapters")][-1] == "0.00"


def test_medians_are_over_rounds_and_each_mix_is_shared_against_its_arms_base() -> None:
    def window(arm: str, label: str, rnd: int, rate: float) -> dict[str, object]:
        return window_row(
            {"arm": arm, "label": label, "tags": {"round": rnd},
             "summary": {"req_per_s": rate, "ttft_ms": {"median": 5.0, "p99": 9.0}}},
            {"running_mean": 4.0, "running_max": 8.0, "loads_per_request": None},
        )

    rows = [window("gateway", "base", 0, 100.0), window("gateway", "base", 1, 60.0),
            window("gateway", "8-adapters", 0, 40.0), window("gateway", "8-adapters", 1, 20.0),
            window("gateway", "8-adapters", 2, 30.0)]
    found = {m["label"]: m for m in medians(rows)}
    assert found["base"]["req_per_s"] == 80.0 and found["base"]["of_base"] == 1.0
    assert found["8-adapters"]["req_per_s"] == 30.0 and found["8-adapters"]["rounds"] == 3
    assert found["8-adapters"]["of_base"] == 30.0 / 80.0
    assert found["8-adapters"]["loads_per_request"] is None
