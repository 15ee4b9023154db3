"""The CPU LoRA op wrappers (server/engines/vllm_cpu_fix.py) against vLLM's own torch ops."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from server.engines import vllm_cpu_fix as cpu_fix
from server.engines.vllm_cpu_fix import skipping_no_lora_rows

torch = pytest.importorskip("torch")
ops = importlib.import_module("vllm.lora.ops.torch_ops.lora_ops")

TOKENS, SLOTS, RANK, WIDTH = 5, 2, 4, 6
INDICES = [0, -1, 1, -1, 0]


def case(kind: str) -> tuple[Any, Any, Any]:
    gen = torch.Generator().manual_seed(0)
    if kind == "shrink":
        inputs = torch.randn(TOKENS, WIDTH, generator=gen)
        weights = torch.randn(SLOTS, 1, RANK, WIDTH, generator=gen)
        output = torch.zeros(TOKENS, RANK)
    else:
        inputs = torch.randn(TOKENS, RANK, generator=gen)
        weights = torch.randn(SLOTS, 1, WIDTH, RANK, generator=gen)
        output = torch.randn(TOKENS, WIDTH + 2, generator=gen)
    return inputs, weights, output


@pytest.mark.parametrize(
    ("name", "kind", "args", "kwargs"),
    [("bgmv_shrink", "shrink", (), {"scaling": 0.5}),
     ("bgmv_expand", "expand", (), {"add_inputs": True}),
     ("bgmv_expand", "expand", (), {"add_inputs": False}),
     ("bgmv_expand_slice", "expand", (1, WIDTH), {"add_inputs": True})],
)
def test_rows_without_lora_are_untouched_and_others_unchanged(
    name: str, kind: str, args: tuple[int, ...], kwargs: dict[str, Any]
) -> None:
    op = getattr(ops, name)
    inputs, weights, output = case(kind)
    indices = torch.tensor(INDICES)
    expected = output.clone()
    op(inputs, weights, expected, indices.clamp(min=0), *args, **kwargs)  # every row with a LoRA
    fixed = output.clone()
    skipping_no_lora_rows(op)(inputs, weights, fixed, indices, *args, **kwargs)
    no_lora = indices < 0
    assert torch.equal(fixed[no_lora], output[no_lora])
    assert torch.equal(fixed[~no_lora], expected[~no_lora])


def test_all_base_batch_is_left_alone_and_all_lora_batch_is_the_original() -> None:
    inputs, weights, output = case("shrink")
    untouched = output.clone()
    skipping_no_lora_rows(ops.bgmv_shrink)(inputs, weights, untouched, torch.full((TOKENS,), -1))
    assert torch.equal(untouched, output)
    indices = torch.tensor([0, 1, 1, 0, 0])
    expected, fixed = output.clone(), output.clone()
    ops.bgmv_shrink(inputs, weights, expected, indices)
    skipping_no_lora_rows(ops.bgmv_shrink)(inputs, weights, fixed, indices)
    assert torch.equal(fixed, expected)


# ---- the fused linear LoRA (one A product for all slices) against vLLM's wrapper with the fix ----

HIDDEN, SLICES = 6, (6, 3, 3)  # a QKV-like layer: three slices of one input


def punica(indices: list[int]) -> Any:
    """vLLM's CPU wrapper holding `indices` as this step's token -> slot mapping (-1: none)."""
    wrapper = importlib.import_module("vllm.lora.punica_wrapper.punica_cpu").PunicaWrapperCPU(
        64, 8, "cpu")
    tokens = torch.tensor(indices)
    wrapper._token_lora_indices[: len(indices)].copy_(tokens)
    wrapper.indices_len = [len(indices), len(indices), len(indices), len(indices)]
    wrapper._update_prefill_metadata(wrapper.token_lora_indices)
    wrapper.is_prefill = True
    return wrapper


def lora_layer(tokens: int, slots: int) -> tuple[Any, tuple[Any, ...], tuple[Any, ...], Any]:
    gen = torch.Generator().manual_seed(tokens + slots)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    a = tuple(torch.randn(slots, 1, RANK, HIDDEN, generator=gen) for _ in SLICES)
    b = tuple(torch.randn(slots, 1, width, RANK, generator=gen) for width in SLICES)
    return x, a, b, torch.randn(tokens, sum(SLICES), generator=gen)


@pytest.mark.parametrize("indices", [
    [0, -1, 1, -1, 0, 1],  # mixed: base rows stay as they were
    [1, 0, 0, 1, 1, 0],  # two adapters
    [1, 1, 1, 1, 1, 1],  # one adapter
    [-1, -1, -1, -1, -1, -1],  # base only
])
@pytest.mark.parametrize(("slices", "scale"), [(3, 1.0), (1, 1.0), (3, 0.5)])
def test_fused_linear_lora_adds_what_vllms_fixed_wrapper_adds(
    monkeypatch: pytest.MonkeyPatch, indices: list[int], slices: int, scale: float
) -> None:
    for module in ("vllm.lora.ops.torch_ops.lora_ops", "vllm.lora.ops.torch_ops",
                   "vllm.lora.punica_wrapper.punica_cpu"):
        loaded = importlib.import_module(module)
        for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
            if hasattr(loaded, name):
                monkeypatch.setattr(loaded, name, skipping_no_lora_rows(getattr(ops, name)))
    x, a, b, y = lora_layer(len(indices), 2)
    a, b, widths = a[:slices], b[:slices], SLICES[:slices]
    y = y[:, : sum(widths)].contiguous()
    wrapper = punica(indices)
    cls = type(wrapper)
    expected, fused = y.clone(), y.clone()
    cls.add_lora_linear(wrapper, expected, x, a, b, scale, widths)
    monkeypatch.setattr(cpu_fix, "_SLOW_LINEAR", [cls.add_lora_linear])
    cpu_fix.fused_add_lora_linear(wrapper, fused, x, a, b, scale, widths)
    torch.testing.assert_close(fused, expected)
    base = torch.tensor(indices) < 0
    assert torch.equal(fused[base], y[base])


def test_fused_linear_lora_leaves_shapes_it_does_not_know_to_vllm() -> None:
    x, a, b, y = lora_layer(4, 2)
    wrapper = punica([0, 1, 0, 1])
    calls: list[tuple[Any, ...]] = []
    original = cpu_fix._SLOW_LINEAR
    cpu_fix._SLOW_LINEAR = [lambda *args, **kw: calls.append(args)]
    try:
        cpu_fix.fused_add_lora_linear(wrapper, y, x, a, b, 1.0, (5, 3, 3))  # widths disagree
        cpu_fix.fused_add_lora_linear(wrapper, y, x, a, b, 1.0, SLICES, buffer=(y,))
        wrapper.is_prefill = False
        cpu_fix.fused_add_lora_linear(wrapper, y, x, a, b, 1.0, SLICES)
    finally:
        cpu_fix._SLOW_LINEAR = original
    assert len(calls) == 3
