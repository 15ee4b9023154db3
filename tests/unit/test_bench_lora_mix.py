"""Scenario L's parts (bench/lora_mix.py): adapters with distinct weights, the metrics it reads,
the mixes (uniform and Zipf), the arms, the summary table and the plot's lines, and its
command-line options (bench/__main__.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from bench.__main__ import _parse, _plan_with_l
from bench.lora_mix import (
    GATEWAY_ARMS,
    choose_arms,
    curves,
    distinct_adapters,
    label_parts,
    medians,
    metric_total,
    mixes,
    table,
    window_row,
    zipf_sequence,
)
from bench.scenarios import Plan
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


def test_a_larger_count_keeps_the_copies_made_before_and_all_stay_distinct(
    tmp_path: Path,
) -> None:
    source = source_adapter(tmp_path / "a1")
    distinct_adapters(2, source, tmp_path / "mix")
    weights = tmp_path / "mix" / "l01" / "adapter_model.safetensors"
    before = weights.stat().st_mtime_ns
    names = distinct_adapters(12, source, tmp_path / "mix")
    assert weights.stat().st_mtime_ns == before
    b_key = next(k for k in load_file(str(weights)) if "lora_B" in k)
    copies = {load_file(str(tmp_path / "mix" / n / "adapter_model.safetensors"))[b_key].tobytes()
              for n in names}
    assert len(copies) == 12


def test_a_folder_made_under_another_scheme_is_rebuilt(tmp_path: Path) -> None:
    source = source_adapter(tmp_path / "a1")
    stale = tmp_path / "mix" / "l00"
    stale.mkdir(parents=True)
    (stale / "adapter_config.json").write_text("{}")
    assert distinct_adapters(1, source, tmp_path / "mix") == ["l00"]
    assert json.loads((stale / "adapter_config.json").read_text())["revision"] == "l00"


def test_mixes_start_with_the_base_model_then_each_k_uniform_and_zipf() -> None:
    names = [f"l{i:02d}" for i in range(8)]
    found = mixes(names, (2, 8), length=50)
    assert [label for label, _ in found] == ["base", "2-uniform", "2-zipf", "8-uniform", "8-zipf"]
    assert found[0] == ("base", ("tiny",))
    assert found[1][1] == ("l00", "l01") and found[3][1] == tuple(names)
    assert found[2][1] == zipf_sequence(names[:2], 50) and len(found[4][1]) == 50
    assert set(found[4][1]) <= set(names)
    assert [label for label, _ in mixes(names, (8,), ("zipf",))] == ["base", "8-zipf"]
    with pytest.raises(ValueError, match="unknown mix"):
        mixes(names, (2,), ("pareto",))


def test_zipf_draws_are_the_same_every_time_and_favour_the_first_ranks() -> None:
    names = [f"l{i:03d}" for i in range(128)]
    drawn = zipf_sequence(names, 4000)
    assert drawn == zipf_sequence(names, 4000)  # every arm and every run: the same sequence
    assert drawn[:192] == zipf_sequence(names, 192)
    assert drawn != zipf_sequence(names, 4000, seed=1)
    counts = Counter(drawn)
    # rank r has weight 1 / r^1.1: the first takes 0.226 of 128, ranks 1-2 twice rank 3-4's share
    assert 0.19 < counts["l000"] / 4000 < 0.26
    assert counts["l000"] > counts["l001"] > counts["l004"]
    assert counts["l000"] + counts["l001"] > 2 * (counts["l002"] + counts["l003"])
    flat = Counter(zipf_sequence(names[:4], 4000, s=0.0))
    assert all(900 < count < 1100 for count in flat.values())


def test_labels_give_k_and_mix_for_this_runs_and_older_ones() -> None:
    assert label_parts("base") == (0, "base")
    assert label_parts("128-zipf") == (128, "zipf")
    assert label_parts("2-uniform") == (2, "uniform")
    assert label_parts("32-adapters") == (32, "uniform")  # runs before the mixes


def test_default_arms_leave_out_fifo_and_unknown_arms_are_refused() -> None:
    assert choose_arms(None) == ("vllm", "slots", "strict", "fair")
    assert choose_arms(("fair", "vllm")) == ("fair", "vllm")
    with pytest.raises(ValueError, match="unknown arms"):
        choose_arms(("vllm", "lru"))


def test_arm_overrides_set_the_active_adapters_and_the_queue_order() -> None:
    def of(arm: str, limit: int | None = None) -> dict[str, object]:
        return GATEWAY_ARMS[arm].overrides(cycle_s=1.5, limit=limit)

    assert of("slots") == {"LimitsConfig": {"fairAdmission": True},
                           "LoraConfig": {"adapterCycleTime": 1.5}}
    assert of("strict") == {"LimitsConfig": {"fairAdmission": True},
                            "LoraConfig": {"adapterCycleTime": 1.5, "maxActiveAdapters": 2}}
    assert of("fifo") == {"LimitsConfig": {"fairAdmission": False},
                          "LoraConfig": {"adapterCycleTime": 1.5, "maxActiveAdapters": 0}}
    assert of("fair", 32) == {"LimitsConfig": {"fairAdmission": True, "maxConcurrentRequests": 32},
                              "LoraConfig": {"adapterCycleTime": 1.5, "maxActiveAdapters": 0}}


def test_the_gateway_knows_every_key_the_arms_set() -> None:
    from server.settings.loader import ALIASES

    for arm in GATEWAY_ARMS.values():
        for section, keys in arm.overrides(cycle_s=1.0, limit=8).items():
            assert all(f"{section}.{key}" in ALIASES for key in keys)


def test_l_options_change_the_plan_and_all_runs_one_round_unless_told() -> None:
    args = _parse(["l", "--l-adapters", "2,32", "--l-mixes", "zipf", "--l-arms", "vllm,fair",
                   "--l-requests", "48", "--l-limit", "32", "--l-cycle", "0.5"])
    plan = _plan_with_l(Plan(), args)
    assert (plan.l_adapters, plan.l_mixes, plan.l_arms) == ((2, 32), ("zipf",), ("vllm", "fair"))
    assert (plan.l_requests, plan.l_gateway_limit, plan.l_cycle_s) == (48, 32, 0.5)
    assert plan.l_rounds == Plan().l_rounds and plan.l_arms is not None
    assert _plan_with_l(Plan(), _parse(["l"])) == Plan()
    assert _plan_with_l(Plan(), _parse(["all"])).l_rounds == Plan().l_rounds_in_all
    assert _plan_with_l(Plan(), _parse(["all", "--l-rounds", "2"])).l_rounds == 2


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


def test_plot_lines_run_from_each_arms_base_through_k_per_mix() -> None:
    def row(arm: str, label: str, rate: float) -> dict[str, object]:
        return {"arm": arm, "label": label, "round": 0, "req_per_s": rate, "ttft_p50_ms": 1.0,
                "ttft_p99_ms": rate, "running_mean": 1.0, "running_max": 1.0,
                "loads_per_request": None}

    lines = curves([row("fair", "32-uniform", 20.0), row("fair", "base", 100.0),
                    row("fair", "2-zipf", 90.0), row("fair", "2-uniform", 80.0),
                    row("vllm", "2-uniform", 50.0)])
    assert set(lines) == {("fair", "uniform"), ("fair", "zipf"), ("vllm", "uniform")}
    assert [(p["k"], p["of_base"]) for p in lines[("fair", "uniform")]] == [
        (0, 1.0), (2, 0.8), (32, 0.2)]
    assert [p["k"] for p in lines[("fair", "zipf")]] == [0, 2]
    assert [(p["k"], p["of_base"]) for p in lines[("vllm", "uniform")]] == [(2, None)]
