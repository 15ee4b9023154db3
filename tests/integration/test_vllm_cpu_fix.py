"""The CPU LoRA op wrappers (server/engines/vllm_cpu_fix.py) against vLLM's own torch ops."""

from __future__ import annotations

import importlib
from collections.abc import Callable
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


INDEX_CASES = [
    [0, -1, 1, -1, 0, 1],  # mixed: base rows stay as they were
    [1, 0, 0, 1, 1, 0],  # two adapters
    [1, 1, 1, 1, 1, 1],  # one adapter
    [-1, -1, -1, -1, -1, -1],  # base only
]


@pytest.fixture
def fixed_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's torch ops with the -1 fix, wherever vLLM bound them (what the fused paths match)."""
    for module in ("vllm.lora.ops.torch_ops.lora_ops", "vllm.lora.ops.torch_ops",
                   "vllm.lora.punica_wrapper.punica_cpu"):
        loaded = importlib.import_module(module)
        for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
            if hasattr(loaded, name):
                monkeypatch.setattr(loaded, name, skipping_no_lora_rows(getattr(ops, name)))


def vllms(wrapper: Any, name: str) -> Any:
    """vLLM's own method `name` of the CPU wrapper, as the fused one falls back to it."""
    method = getattr(type(wrapper), name)
    cpu_fix._ORIGINAL[name] = method
    return method


@pytest.mark.usefixtures("fixed_ops")
@pytest.mark.parametrize("indices", INDEX_CASES)
@pytest.mark.parametrize(("slices", "scale"), [(3, 1.0), (1, 1.0), (3, 0.5)])
def test_fused_linear_lora_adds_what_vllms_fixed_wrapper_adds(
    indices: list[int], slices: int, scale: float
) -> None:
    x, a, b, y = lora_layer(len(indices), 2)
    a, b, widths = a[:slices], b[:slices], SLICES[:slices]
    y = y[:, : sum(widths)].contiguous()
    wrapper = punica(indices)
    expected, fused = y.clone(), y.clone()
    vllms(wrapper, "add_lora_linear")(wrapper, expected, x, a, b, scale, widths)
    cpu_fix.fused_add_lora_linear(wrapper, fused, x, a, b, scale, widths)
    torch.testing.assert_close(fused, expected)
    base = torch.tensor(indices) < 0
    assert torch.equal(fused[base], y[base])


@pytest.mark.usefixtures("fixed_ops")
def test_an_adapter_with_weights_that_are_not_finite_reaches_no_other_row() -> None:
    """One matrix product over every slot's B would spread slot 1's NaN to slot 0's and the
    base rows (zero times NaN): such weights go to vLLM's own per-token path."""
    indices = [0, -1, 1, 0]
    x, a, b, y = lora_layer(len(indices), 2)
    b[1][1, 0, 0, 0] = float("nan")
    wrapper = punica(indices)
    expected, fused = y.clone(), y.clone()
    vllms(wrapper, "add_lora_linear")(wrapper, expected, x, a, b, 1.0, SLICES)
    cpu_fix.fused_add_lora_linear(wrapper, fused, x, a, b, 1.0, SLICES)
    torch.testing.assert_close(fused, expected, equal_nan=True)
    mine = torch.tensor(indices) != 1
    assert bool(torch.isfinite(fused[mine]).all())
    assert torch.equal(fused[1], y[1])


def calls_to_vllm(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record which of vLLM's own methods the fused ones fall back to."""
    calls: list[str] = []
    for name in ("add_lora_linear", "add_lora_embedding", "add_lora_logits", "update_metadata"):
        monkeypatch.setitem(cpu_fix._ORIGINAL, name,
                            lambda *args, _name=name, **kw: calls.append(_name))
    return calls


def test_fused_linear_lora_leaves_shapes_it_does_not_know_to_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, a, b, y = lora_layer(4, 2)
    wrapper = punica([0, 1, 0, 1])
    calls = calls_to_vllm(monkeypatch)
    cpu_fix.fused_add_lora_linear(wrapper, y, x, a, b, 1.0, (5, 3, 3))  # widths disagree
    cpu_fix.fused_add_lora_linear(wrapper, y, x, a, b, 1.0, SLICES, buffer=(y,))
    wrapper.is_prefill = False
    cpu_fix.fused_add_lora_linear(wrapper, y, x, a, b, 1.0, SLICES)
    assert calls == ["add_lora_linear"] * 3


# ---- the embedding LoRA (y += x @ B per token's slot) ----

def embedding_case(tokens: int, slots: int, width: int = HIDDEN) -> tuple[Any, Any, Any]:
    gen = torch.Generator().manual_seed(tokens * 7 + slots)
    x = torch.randn(tokens, RANK, generator=gen)  # the tokens' LoRA-A rows, as vLLM looks them up
    b = torch.randn(slots, 1, width, RANK, generator=gen)
    return x, b, torch.randn(tokens, HIDDEN, generator=gen)


@pytest.mark.usefixtures("fixed_ops")
@pytest.mark.parametrize("indices", INDEX_CASES)
@pytest.mark.parametrize(("slots", "width"), [(2, HIDDEN), (3, HIDDEN), (2, HIDDEN + 2),
                                              (2, HIDDEN - 2)])  # vLLM adds the common part
def test_fused_embedding_lora_adds_what_vllms_fixed_wrapper_adds(
    indices: list[int], slots: int, width: int
) -> None:
    x, b, y = embedding_case(len(indices), slots, width)
    wrapper = punica(indices)
    expected, fused = y.clone(), y.clone()
    vllms(wrapper, "add_lora_embedding")(wrapper, expected, x, b, add_input=True)  # vLLM's call
    cpu_fix.fused_add_lora_embedding(wrapper, fused, x, b, add_input=True)
    torch.testing.assert_close(fused, expected)
    base = torch.tensor(indices) < 0
    assert torch.equal(fused[base], y[base])


def test_fused_embedding_lora_leaves_other_modes_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    x, b, y = embedding_case(4, 2)
    wrapper = punica([0, 1, -1, 1])
    calls = calls_to_vllm(monkeypatch)
    cpu_fix.fused_add_lora_embedding(wrapper, y, x, b, add_inputs=False)  # assignment
    cpu_fix.fused_add_lora_embedding(wrapper, y, x[:, :-1], b)  # ranks disagree
    wrapper.is_prefill = False
    cpu_fix.fused_add_lora_embedding(wrapper, y, x, b)
    assert calls == ["add_lora_embedding"] * 3


# ---- the logits LoRA (y += (x @ A) * scale @ B per sampled row's slot) ----

VOCAB = 11


def logits_case(rows: int, slots: int, padded: int = VOCAB) -> tuple[Any, Any, Any, Any]:
    """Logits of `padded` columns (the head's padded vocabulary), B of VOCAB outputs."""
    gen = torch.Generator().manual_seed(rows * 5 + slots)
    x = torch.randn(rows, HIDDEN, generator=gen)
    a = torch.randn(slots, 1, RANK, HIDDEN, generator=gen)
    b = torch.randn(slots, 1, VOCAB, RANK, generator=gen)
    return x, a, b, torch.randn(rows, padded, generator=gen)


def sampling(wrapper: Any, rows: list[int]) -> Any:
    """The wrapper with `rows` as this step's sampled rows' slots (vLLM's sampler indices)."""
    wrapper._sampler_indices[: len(rows)].copy_(torch.tensor(rows))
    wrapper.indices_len[1] = len(rows)
    return wrapper


@pytest.mark.usefixtures("fixed_ops")
@pytest.mark.parametrize("rows", [*INDEX_CASES, [1, -1, 0]])
@pytest.mark.parametrize(("scale", "padded"), [(1.0, VOCAB), (0.5, VOCAB), (1.0, VOCAB + 5)])
def test_fused_logits_lora_adds_what_vllms_fixed_wrapper_adds(
    rows: list[int], scale: float, padded: int
) -> None:
    x, a, b, y = logits_case(len(rows), 2, padded)
    wrapper = sampling(punica([0] * 9), rows)  # more tokens than sampled rows, as in a prefill
    expected, fused = y.clone(), y.clone()
    vllms(wrapper, "add_lora_logits")(wrapper, expected, x, a, b, scale)
    cpu_fix.fused_add_lora_logits(wrapper, fused, x, a, b, scale)
    torch.testing.assert_close(fused, expected)
    base = torch.tensor(rows) < 0
    assert torch.equal(fused[base], y[base])


def test_fused_logits_lora_leaves_other_shapes_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    x, a, b, y = logits_case(3, 2)
    wrapper = sampling(punica([0, 1, 1]), [0, 1, -1])
    calls = calls_to_vllm(monkeypatch)
    cpu_fix.fused_add_lora_logits(wrapper, y, x, a, b, 1.0, buffer=torch.zeros(3, RANK))
    cpu_fix.fused_add_lora_logits(wrapper, y[:2], x[:2], a, b, 1.0)  # fewer rows than indices
    cpu_fix.fused_add_lora_logits(wrapper, y, x, a[:, :, :-1], b, 1.0)  # ranks disagree
    assert calls == ["add_lora_logits"] * 3


# ---- the per-step metadata (slot indices, prefill runs) ----

def mapping(tokens: list[int], prompts: list[int], *, prefill: bool = True) -> Any:
    layers = importlib.import_module("vllm.lora.layers")
    return layers.LoRAMapping(tuple(tokens), tuple(prompts), is_prefill=prefill)


def metadata(wrapper: Any, prefill_metadata: Callable[[Any], Any]) -> tuple[Any, ...]:
    """Everything update_metadata sets, prefill runs read through `prefill_metadata`."""
    lengths = list(wrapper.indices_len)
    return (
        lengths, wrapper.is_prefill, wrapper.no_lora,
        wrapper.token_lora_indices.tolist(), wrapper.sampler_indices.tolist(),
        wrapper.sampler_indices_padded.tolist(),
        wrapper._embeddings_indices[: lengths[3]].tolist(),
        [part.tolist() if hasattr(part, "tolist") else part
         for part in prefill_metadata(wrapper)],
    )


@pytest.mark.parametrize(("tokens", "prompts", "prefill"), [
    ([7, 7, 0, 9, 9, 9, 0, 7], [7, 0, 9, 7], True),  # mixed, runs of each
    ([9, 7, 7, 9], [9, 7, 7, 9], True),  # two adapters, decode-like (one token per request)
    ([7, 7, 7], [7], True),  # one adapter
    ([0, 0, 0, 0], [0, 0], True),  # base only
    ([7, 0, 9], [7, 0, 9], False),  # vLLM's decode mode
    ([7, 7, 9], [], True),  # a chunk of prompts that samples no row
])
def test_fast_metadata_is_vllms(tokens: list[int], prompts: list[int], prefill: bool) -> None:
    slots: list[int | None] = [9, None, 7]  # slot -> adapter id, with a free slot between
    cpu = importlib.import_module("vllm.lora.punica_wrapper.punica_cpu").PunicaWrapperCPU
    step = mapping(tokens, prompts, prefill=prefill)
    expected, fast = cpu(64, 8, "cpu"), cpu(64, 8, "cpu")
    original = vllms(expected, "update_metadata")
    original(expected, mapping([7, 9], [7, 9]), slots, 4, VOCAB)  # a previous step each
    original(expected, step, slots, 4, VOCAB)
    cpu_fix.fast_update_metadata(fast, mapping([7, 9], [7, 9]), slots, 4, VOCAB)
    cpu_fix.fast_update_metadata(fast, step, slots, 4, VOCAB)
    assert fast.__dict__.get(cpu_fix._STALE, False) == prefill  # runs computed only when read
    assert metadata(fast, cpu_fix._lazy_prefill_metadata) == metadata(
        expected, lambda wrapper: wrapper.prefill_metadata)


def test_fast_metadata_leaves_an_unknown_adapter_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = calls_to_vllm(monkeypatch)
    wrapper = punica([0])
    cpu_fix.fast_update_metadata(wrapper, mapping([7, 5], [7, 5]), [7, None], 2, VOCAB)
    assert calls == ["update_metadata"]


@pytest.mark.usefixtures("fixed_ops")
def test_rows_made_once_per_step_follow_each_step() -> None:
    """The fused paths reuse the rows `fast_update_metadata` made for the step, and a new step's
    rows replace them: two steps with different mappings, each equal to vLLM's own."""
    slots: list[int | None] = [9, None, 7]
    cpu = importlib.import_module("vllm.lora.punica_wrapper.punica_cpu").PunicaWrapperCPU
    expected, fast = cpu(64, 8, "cpu"), cpu(64, 8, "cpu")
    original = vllms(expected, "update_metadata")
    vllms(expected, "add_lora_linear")
    for tokens in ([7, 0, 9, 9, 7, 0], [9, 9, 9, 7, 7, 7]):
        step = mapping(tokens, tokens)
        original(expected, step, slots, 4, VOCAB)
        cpu_fix.fast_update_metadata(fast, step, slots, 4, VOCAB)
        x, a, b, y = lora_layer(len(tokens), 4)
        want, got = y.clone(), y.clone()
        cpu_fix._ORIGINAL["add_lora_linear"](expected, want, x, a, b, 1.0, SLICES)
        cpu_fix.fused_add_lora_linear(fast, got, x, a, b, 1.0, SLICES)
        torch.testing.assert_close(got, want)


def test_weights_made_once_follow_weights_written_in_place() -> None:
    _, a, b, _ = lora_layer(2, 2)
    first = cpu_fix._weights(a, b, torch.float32)
    assert cpu_fix._weights(a, b, torch.float32) is first  # made once for the same contents
    a[1][0].copy_(torch.ones_like(a[1][0]))  # vLLM loading an adapter into slot 0
    b[2][0].copy_(torch.ones_like(b[2][0]))
    again = cpu_fix._weights(a, b, torch.float32)
    assert again is not None and again is not first
    torch.testing.assert_close(again.a, torch.cat(a, dim=-2).reshape(-1, HIDDEN).t())
    rank = a[0].shape[-2]
    assert bool((again.b[: 3 * rank, -SLICES[2]:][2 * rank :] == 1).all())  # slot 0, slice 2


@pytest.mark.usefixtures("fixed_ops")
def test_a_layer_no_loaded_adapter_changes_is_skipped_until_one_does() -> None:
    """vLLM zeroes a slot's weights for a module its adapter leaves out (`reset_lora`): with
    every slot's B zero the layer adds nothing, and the product is skipped. An adapter written
    into a slot in place (`set_lora`) is applied from the next call on."""
    indices = [0, -1, 1, 0]
    x, a, b, y = lora_layer(len(indices), 2)
    for slice_b in b:
        slice_b.zero_()
    wrapper = punica(indices)
    skipped = y.clone()
    cpu_fix.fused_add_lora_linear(wrapper, skipped, x, a, b, 1.0, SLICES)
    assert torch.equal(skipped, y)
    b[1][1].copy_(torch.ones_like(b[1][1]))  # slot 1's adapter changes the second slice
    expected, fused = y.clone(), y.clone()
    vllms(wrapper, "add_lora_linear")(wrapper, expected, x, a, b, 1.0, SLICES)
    cpu_fix.fused_add_lora_linear(wrapper, fused, x, a, b, 1.0, SLICES)
    torch.testing.assert_close(fused, expected)
    assert not torch.equal(fused[2], y[2])
