"""The CPU LoRA op wrappers (server/engines/vllm_cpu_fix.py) against vLLM's own torch ops."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

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
