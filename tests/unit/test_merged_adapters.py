"""Adapters composed per request (`merged_adapters`): the tensor math against a dense reference,
the wire object's refusals, and the registry's cache of composed adapters (fake engine)."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from server.core.adapter_files import AdapterRules, inspect_adapter
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.core.composition import Composition, MergeInput, merge_from_wire
from server.core.errors import (
    AdapterInvalid,
    AdapterNotFound,
    InvalidRequest,
    LoraDisabled,
    Unsupported,
)
from server.core.types import AdapterMerge
from server.engines.fake import FakeEngine
from server.engines.lora_merge import NumpyComposer, read_adapter, vllm_scaling
from tests.unit.demo_kit import SHAPE, WIDTHS, unit_demo, write_adapter
from tests.unit.gateway_kit import client, make_gateway

pytestmark = pytest.mark.anyio
PREFIX = "base_model.model.model.layers"


def random_adapter(
    folder: Path, seed: int, *, rank: int = 4, alpha: float = 16,
    modules: tuple[str, ...] = ("q_proj", "v_proj"), config: dict[str, Any] | None = None,
    ranks: dict[str, int] | None = None, dtype: str = "float32",
) -> Path:
    """A LoRA adapter with random factors fitting demo_kit.SHAPE; `ranks` gives a module's
    tensor rank (with a matching rank_pattern in `config`)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
           "bias": "none", "base_model_name_or_path": "tiny", **(config or {})}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = {}
    for layer in range(2):
        for module in modules:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            width_in, width_out = WIDTHS[module]
            r = (ranks or {}).get(module, rank)
            name = f"{PREFIX}.{layer}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.standard_normal((r, width_in)).astype(dtype)
            tensors[f"{name}.lora_B.weight"] = rng.standard_normal((width_out, r)).astype(dtype)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def dense_deltas(folder: Path) -> dict[str, np.ndarray]:
    """ΔW of every module as vLLM applies it: scaling · B · A (float64)."""
    modules, _, _ = read_adapter(folder)
    return {
        m: f.scaling * (f.b.astype(np.float64) @ f.a.astype(np.float64))
        for m, f in modules.items()
    }


def rules(root: Path, max_rank: int = 64) -> AdapterRules:
    return AdapterRules(roots=(str(root),), max_rank=max_rank, base_names=frozenset({"tiny"}),
                        base_shape=SHAPE)


def compose(root: Path, parts: list[tuple[Path, float]], rank_of: dict[Path, int]) -> Path:
    out = root / "cache" / "out"
    out.parent.mkdir(exist_ok=True)
    inputs = [MergeInput(p.name, str(p), rank_of[p], w) for p, w in parts]
    NumpyComposer().compose(inputs, out)
    return out


# ---- the math ---------------------------------------------------------------------------------
def test_linear_is_the_exact_weighted_sum_of_the_deltas(tmp_path: Path) -> None:
    """Σ wᵢ·sᵢ·BᵢAᵢ (sᵢ: α/r, α/√r with rsLoRA, rank_pattern/alpha_pattern per module) equals
    the composed (α/r)·B·A; rank = Σ rᵢ, modules = the union, every module at the full rank."""
    a = random_adapter(tmp_path / "a", 1, rank=4, alpha=16)
    b = random_adapter(tmp_path / "b", 2, rank=2, alpha=3, modules=("q_proj", "o_proj", "up_proj"),
                       config={"use_rslora": True})
    c = random_adapter(tmp_path / "c", 3, rank=4, alpha=8, modules=("v_proj", "down_proj"),
                       config={"rank_pattern": {"down_proj": 2}, "alpha_pattern": {"v_proj": 5}},
                       ranks={"down_proj": 2})
    weights = {a: 0.7, b: -0.3, c: 1.25}
    out = compose(tmp_path, list(weights.items()), {a: 4, b: 2, c: 4})

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 10
    assert not config["use_rslora"] and not config["rank_pattern"]
    assert config["target_modules"] == ["down_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert {t.shape[0] for k, t in tensors.items() if "lora_A" in k} == {10}
    expected: dict[str, np.ndarray] = {}
    for folder, weight in weights.items():
        for module, delta in dense_deltas(folder).items():
            expected[module] = expected.get(module, 0) + weight * delta
    composed = dense_deltas(out)
    assert composed.keys() == expected.keys()
    for module, delta in expected.items():
        np.testing.assert_allclose(composed[module], delta, rtol=1e-5, atol=1e-5)
    assert inspect_adapter(str(out), rules(tmp_path)).rank == 10  # a valid adapter folder


def test_scaling_follows_vllm() -> None:
    config = {"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4},
              "alpha_pattern": {"layers.1.self_attn.v_proj": 2}}
    assert vllm_scaling(config, "model.layers.0.self_attn.q_proj") == 4.0
    assert vllm_scaling(config, "model.layers.1.self_attn.v_proj") == 0.25
    assert vllm_scaling(config, "model.layers.0.self_attn.v_proj") == 2.0
    assert vllm_scaling({**config, "use_rslora": True}, "model.layers.0.mlp.up_proj") == (
        16 / math.sqrt(8)
    )


def test_half_precision_inputs_stay_half_and_mixed_become_float32(tmp_path: Path) -> None:
    a = random_adapter(tmp_path / "a", 1, dtype="float16")
    b = random_adapter(tmp_path / "b", 2, dtype="float16")
    out = compose(tmp_path, [(a, 0.5), (b, 0.5)], {a: 4, b: 4})
    assert {t.dtype for t in load_file(str(out / "adapter_model.safetensors")).values()} == {
        np.dtype("float16")
    }
    c = random_adapter(tmp_path / "c", 3)
    out2 = tmp_path / "cache" / "out2"
    NumpyComposer().compose([MergeInput("a", str(a), 4, 1.0), MergeInput("c", str(c), 4, 1.0)],
                            out2)
    assert {t.dtype for t in load_file(str(out2 / "adapter_model.safetensors")).values()} == {
        np.dtype("float32")
    }


def test_shapes_that_disagree_are_refused(tmp_path: Path) -> None:
    a = random_adapter(tmp_path / "a", 1)
    b = random_adapter(tmp_path / "b", 2)
    tensors = load_file(str(b / "adapter_model.safetensors"))
    key = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = np.zeros((4, 7), np.float32)
    save_file(tensors, str(b / "adapter_model.safetensors"))
    with pytest.raises(AdapterInvalid, match="disagree on the shape"):
        compose(tmp_path, [(a, 1.0), (b, 1.0)], {a: 4, b: 4})
    assert not (tmp_path / "cache" / "out").exists()  # nothing half-written


# ---- the wire object --------------------------------------------------------------------------
def test_wire_defaults() -> None:
    merge = merge_from_wire({"ids": ["a1", "a2"]})
    assert merge == AdapterMerge(ids=("a1", "a2"), weights=(1.0, 1.0))
    merge = merge_from_wire({"ids": ["a1"], "weights": [2], "merge_strategy": "LINEAR",
                             "density": 0.5, "majority_sign_method": "frequency", "other": 1})
    assert (merge.weights, merge.strategy, merge.density, merge.majority_sign_method) == (
        (2.0,), "linear", 0.5, "frequency"
    )


@pytest.mark.parametrize(("value", "message"), [
    ("a1", "must be an object"),
    ({}, "at least one adapter ID"),
    ({"ids": []}, "at least one adapter ID"),
    ({"ids": "a1"}, "`ids` must be a list"),
    ({"ids": ["a1", 3]}, "`ids` must be a list"),
    ({"ids": ["a1", ""]}, "`ids` must be a list"),
    ({"ids": [f"a{i}" for i in range(17)]}, "at most 16"),
    ({"ids": ["a1", "a2"], "weights": [1.0]}, "must match number of adapter weights"),
    ({"ids": ["a1"], "weights": []}, "must match number of adapter weights"),
    ({"ids": ["a1"], "weights": [float("nan")]}, "finite numbers"),
    ({"ids": ["a1"], "weights": [float("inf")]}, "finite numbers"),
    ({"ids": ["a1"], "weights": ["0.5"]}, "finite numbers"),
    ({"ids": ["a1"], "weights": [True]}, "finite numbers"),
    ({"ids": ["a1"], "weights": 1.0}, "finite numbers"),
    ({"ids": ["a1"], "merge_strategy": "svd"}, "`merge_strategy` must be one of"),
    ({"ids": ["a1"], "merge_strategy": 1}, "`merge_strategy` must be one of"),
    ({"ids": ["a1"], "density": 1.5}, "`density` must be >= 0.0 and <= 1.0"),
    ({"ids": ["a1"], "density": "x"}, "`density` must be >= 0.0 and <= 1.0"),
    ({"ids": ["a1"], "majority_sign_method": "most"}, "`majority_sign_method` must be one of"),
])
def test_bad_wire_objects(value: object, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        merge_from_wire(value)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12,
)
WIRE = st.fixed_dictionaries({}, optional={
    "ids": JSON | st.lists(st.sampled_from(["a1", "a2", ""]), max_size=3),
    "weights": JSON | st.lists(st.floats() | st.integers(), max_size=3),
    "merge_strategy": JSON | st.sampled_from(["linear", "ties", "LINEAR"]),
    "density": JSON, "majority_sign_method": JSON | st.sampled_from(["total", "frequency"]),
})


@given(value=JSON | WIRE)
def test_any_json_is_a_merge_or_a_client_error(value: object) -> None:
    try:
        merge = merge_from_wire(value)
    except InvalidRequest:
        return
    assert merge.strategy == "linear" and len(merge.weights) == len(merge.ids) >= 1
    assert all(math.isfinite(w) for w in merge.weights)


@pytest.mark.parametrize("strategy", ["ties", "dare_linear", "dare_ties"])
def test_inexact_strategies_are_refused_naming_linear(strategy: str) -> None:
    with pytest.raises(Unsupported, match="only `linear`"):
        merge_from_wire({"ids": ["a1", "a2"], "merge_strategy": strategy, "density": 0.5})


# ---- the registry's composed adapters ---------------------------------------------------------
@pytest.fixture
def registry(tmp_path: Path) -> AdapterRegistry:
    root = tmp_path / "adapters"
    for index, name in enumerate(("a1", "a2", "a3")):
        random_adapter(root / name, index, rank=4)
    write_adapter(root / "r8", rank=8)
    registry = AdapterRegistry(
        engine=FakeEngine(model_name="tiny"), rules=rules(tmp_path, max_rank=8),
        limits=AdapterLimits(enabled=True, max_loras=2, max_cpu_loras=4, settle_s=0.0,
                             discovery_dirs=(str(root),)),
    )
    registry.composition = Composition(NumpyComposer(), tmp_path / "merged", max_entries=2)
    return registry


async def test_a_composition_is_built_once_and_not_listed(registry: AdapterRegistry) -> None:
    merge = AdapterMerge(ids=("a1", "a2"), weights=(0.7, 0.3))
    names = {await registry.compose(merge) for _ in range(3)}
    assert len(names) == 1
    name = names.pop()
    assert name.startswith("merged-") and name not in registry and name not in registry.names()
    assert [r.name for r in registry.merged_records()] == [name]
    assert len(list((registry.composition.folder).iterdir())) == 1  # type: ignore[union-attr]
    handle = await registry.acquire_merged(merge)
    assert handle.name == name
    registry.release(handle)
    other = AdapterMerge(ids=("a1", "a2"), weights=(0.7, 0.30000000000000004))
    assert await registry.compose(other) != name  # exact weights select the adapter


async def test_concurrent_first_requests_share_one_build(registry: AdapterRegistry) -> None:
    merge = AdapterMerge(ids=("a1", "a3"), weights=(1.0, -1.0))
    names = await asyncio.gather(*(registry.compose(merge) for _ in range(8)))
    assert len(set(names)) == 1 and len(registry.merged_records()) == 1


async def test_least_recently_used_composition_goes_beyond_the_bound(
    registry: AdapterRegistry,
) -> None:
    first = await registry.compose(AdapterMerge(ids=("a1",), weights=(1.0,)))
    await registry.compose(AdapterMerge(ids=("a2",), weights=(1.0,)))
    await registry.compose(AdapterMerge(ids=("a3",), weights=(1.0,)))
    names = {r.name for r in registry.merged_records()}
    assert len(names) == 2 and first not in names
    assert await registry.compose(AdapterMerge(ids=("a1",), weights=(1.0,))) == first  # cached


async def test_refusals(registry: AdapterRegistry) -> None:
    with pytest.raises(AdapterNotFound, match="`nope` does not exist"):
        await registry.compose(AdapterMerge(ids=("a1", "nope"), weights=(1.0, 1.0)))
    with pytest.raises(AdapterNotFound):  # a composed adapter is not an input
        name = await registry.compose(AdapterMerge(ids=("a1",), weights=(1.0,)))
        await registry.compose(AdapterMerge(ids=(name,), weights=(1.0,)))
    with pytest.raises(AdapterInvalid, match=r"rank 12 .* greater than max_lora_rank 8"):
        await registry.compose(AdapterMerge(ids=("a1", "a2", "a3"), weights=(1.0, 1.0, 1.0)))
    with pytest.raises(AdapterInvalid, match="rank 12"):
        await registry.compose(AdapterMerge(ids=("a1", "r8"), weights=(1.0, 1.0)))
    registry.composition = None
    with pytest.raises(LoraDisabled):
        await registry.compose(AdapterMerge(ids=("a1",), weights=(1.0,)))


async def test_the_cache_folder_is_bounded_and_a_lost_folder_is_composed_again(
    registry: AdapterRegistry, tmp_path: Path,
) -> None:
    cache = tmp_path / "merged"
    for weight in range(1, 12):
        await registry.compose(AdapterMerge(ids=("a1",), weights=(float(weight),)))
    folders = {str(p.resolve()) for p in cache.iterdir()}
    assert len(folders) == 4 * 2  # CACHED_PER_ENTRY * max_entries
    assert {r.handle.path for r in registry.merged_records()} <= folders
    merge = AdapterMerge(ids=("a2",), weights=(1.0,))
    name = await registry.compose(merge)
    shutil.rmtree(registry.get(name).handle.path)
    assert await registry.compose(merge) == name
    handle = await registry.acquire_merged(merge)
    assert (Path(handle.path) / "adapter_config.json").is_file()
    registry.release(handle)


# ---- the protocols, in process on the fake engine ----------------------------------------------
async def test_tgi_and_openai_carry_merged_adapters(tmp_path: Path) -> None:
    demo = unit_demo()
    gateway = make_gateway(overrides={"LoraConfig": {
        "adapterDir": str(demo / "adapters"), "adapterRoots": [str(demo)], "maxLoraRank": 16,
        "mergedAdapterDir": str(tmp_path / "merged"),
    }})
    merge = {"ids": ["a1", "a2"], "weights": [0.5, 0.5]}
    async with client(gateway, "data") as http:
        body = {"inputs": "hi", "parameters": {"max_new_tokens": 2, "merged_adapters": merge}}
        response = await http.post("/generate", json=body)
        assert response.status_code == 200, response.text
        [record] = gateway.adapters.merged_records()
        assert record.requests == 1
        response = await http.post("/v1/completions", json={
            "model": "tiny", "prompt": "hi", "max_tokens": 2, "merged_adapters": merge})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "tiny" and record.requests == 2
        response = await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "merged_adapters": merge, "stream": True})
        assert response.status_code == 200 and record.requests == 3
        models = (await http.get("/v1/models")).json()["data"]
        assert record.name not in {m["id"] for m in models}
        response = await http.post("/v1/completions", json={
            "model": record.name, "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 404  # not a name clients can use
        response = await http.post("/v1/completions", json={
            "model": "a1", "prompt": "hi", "merged_adapters": merge})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "merged_adapters"
        body["parameters"]["merged_adapters"] = {"ids": ["a1"], "weights": [None]}
        response = await http.post("/generate", json=body)
        assert response.status_code == 422
        assert response.json() == {
            "error": "Input validation error: `weights` must be a list of finite numbers",
            "error_type": "validation",
        }
