"""A fix for vLLM's CPU LoRA kernels, loaded into vLLM's worker process.

vLLM marks tokens without a LoRA with index -1. The Triton kernels skip them; the PyTorch ops the
CPU platform uses (`vllm/lora/ops/torch_ops/lora_ops.py`) index `weights[-1]` instead, so a
base-model request batched next to LoRA requests silently gets the last engine slot's adapter
applied (measured here: base outputs change whenever LoRA traffic runs at the same time). Upstream
fix: vllm-project/vllm PR #48421 (open when written). This module wraps the three `bgmv_*` ops so
-1 rows are left untouched, exactly as the Triton kernels do; valid rows are computed unchanged.

It also replaces `PunicaWrapperCPU.add_lora_linear` (every linear layer's LoRA), the cost of
adapter traffic on CPU: adapter requests batch in the engine exactly as base requests do (same
steps, same tokens per step), but vLLM's torch ops gather a weight matrix per token and take
about 20 torch calls per slice, and under two-adapter traffic they were about 49 % of the
worker's model step on the demo model (py-spy). `fused_add_lora_linear` computes every slot's
LoRA-A product for all of a layer's slices in one matrix multiply and each slice's LoRA-B in one
more, each token keeping its own slot's columns (33 % of the step after; LoRA work per unit of
base matrix work about 5.2 -> 2.6; bench/ANALYSIS.md). Base rows (-1) get nothing added; any
other shape or mode goes to vLLM's own method (which runs on the wrapped ops above).

How it is loaded: `VllmEngineOptions` names `CpuLoraFix` as vLLM's `worker_extension_cls`, which
vLLM resolves inside every worker process (where the model runs) before the model is built.
Resolving that name (module `__getattr__`) installs the wrappers and the fused method there;
importing the module has no effect, and the gateway's own process never resolves it. vLLM and
torch are imported by name at run time so that only the engine adapter depends on vLLM
statically.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
_MODULES = (
    "vllm.lora.ops.torch_ops.lora_ops",  # sgmv_* call bgmv_* through these globals
    "vllm.lora.ops.torch_ops",
    "vllm.lora.punica_wrapper.punica_cpu",
)
_MARK = "_gateway_skips_no_lora_rows"


def skipping_no_lora_rows(op: Callable[..., None]) -> Callable[..., None]:
    """`op(inputs, weights, output, indices, ...)` that leaves rows with index -1 as they were."""

    def run(inputs: Any, weights: Any, output: Any, indices: Any, *rest: Any, **kw: Any) -> None:
        mask = indices < 0
        if not bool(mask.any()):
            op(inputs, weights, output, indices, *rest, **kw)
            return
        if bool(mask.all()):
            return
        rows = output.shape[0]
        if mask.shape[0] < rows:  # a broadcast the original handles itself; keep its behaviour
            op(inputs, weights, output, indices, *rest, **kw)
            return
        mask = mask[:rows]
        kept = output[mask].clone()
        op(inputs, weights, output, indices.clamp(min=0), *rest, **kw)
        output[mask] = kept

    setattr(run, _MARK, True)
    run.__name__ = getattr(op, "__name__", "op")
    return run


def fused_add_lora_linear(  # noqa: PLR0913 - vLLM's signature
    wrapper: Any, y: Any, x: Any, lora_a_stacked: tuple[Any, ...],
    lora_b_stacked: tuple[Any, ...], scale: float, output_slices: tuple[int, ...], **kw: Any,
) -> None:
    """`PunicaWrapperCPU.add_lora_linear` in a few torch calls per slice instead of ~20: every
    slot's LoRA-A product for all slices in one matrix multiply, each token keeping its own
    slot's columns, then one multiply per slice for LoRA-B. Rows without a LoRA (-1) get
    nothing added, as with the fixed ops. Anything unusual goes to vLLM's own method."""
    indices = wrapper.token_lora_indices
    if not wrapper.is_prefill or kw.get("buffer") is not None or not _plain(
        y, x, indices, lora_a_stacked, lora_b_stacked, output_slices
    ):
        _SLOW_LINEAR[0](wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kw)
        return
    rows = x.shape[0]
    if wrapper.no_lora:
        return
    torch = importlib.import_module("torch")
    slot = indices.clamp(min=0)
    token = torch.arange(rows, device=x.device)
    base_rows = indices < 0
    mixed = bool(base_rows.any())
    weights_a = torch.cat(lora_a_stacked, dim=-2) if len(lora_a_stacked) > 1 else lora_a_stacked[0]
    slots, rank = weights_a.shape[0], lora_a_stacked[0].shape[-2]
    flat_a = weights_a.to(dtype=torch.float32).reshape(-1, x.shape[-1])
    shrunk = (x.to(dtype=torch.float32) @ flat_a.t()).view(rows, slots, -1)[token, slot]
    if scale != 1.0:
        shrunk = shrunk * scale
    if mixed:
        shrunk.masked_fill_(base_rows[:, None], 0.0)
    shrunk = shrunk.to(dtype=y.dtype)
    offset = 0
    for index, width in enumerate(output_slices):
        weights_b = lora_b_stacked[index].to(dtype=y.dtype).reshape(slots * width, rank)
        part = shrunk[:, index * rank : (index + 1) * rank] @ weights_b.t()
        part = part.view(rows, slots, width)[token, slot]
        if mixed:
            part.masked_fill_(base_rows[:, None], 0.0)
        y[:, offset : offset + width] += part
        offset += width


def _plain(
    y: Any, x: Any, indices: Any, lora_a_stacked: tuple[Any, ...],
    lora_b_stacked: tuple[Any, ...], output_slices: tuple[int, ...],
) -> bool:
    """One row of x and y and one index per token; every slice's A of one shape (slots x 1 x
    rank x in) and its B of slots x 1 x (its output width) x rank."""
    if x.dim() != 2 or y.dim() != 2 or not x.shape[0] == y.shape[0] == indices.shape[0]:
        return False
    shape_a = tuple(lora_a_stacked[0].shape)
    if len(shape_a) != 4 or shape_a[1] != 1 or shape_a[3] != x.shape[1]:
        return False
    if any(tuple(a.shape) != shape_a for a in lora_a_stacked):
        return False
    slots, _, rank, _ = shape_a
    return len(lora_b_stacked) == len(output_slices) == len(lora_a_stacked) and all(
        tuple(b.shape) == (slots, 1, width, rank)
        for b, width in zip(lora_b_stacked, output_slices, strict=True)
    )


_SLOW_LINEAR: list[Callable[..., None]] = []  # vLLM's own add_lora_linear


def install() -> None:
    """Wrap the ops wherever vLLM bound them, and fuse the CPU wrapper's linear LoRA.
    Idempotent."""
    modules = [importlib.import_module(name) for name in _MODULES]
    originals = {name: getattr(modules[0], name) for name in _OPS}
    for name, op in originals.items():
        wrapped = op if getattr(op, _MARK, False) else skipping_no_lora_rows(op)
        for module in modules:
            if hasattr(module, name):
                setattr(module, name, wrapped)
    cpu = importlib.import_module(_MODULES[2]).PunicaWrapperCPU
    if not _SLOW_LINEAR:
        _SLOW_LINEAR.append(cpu.add_lora_linear)
        cpu.add_lora_linear = fused_add_lora_linear


class _CpuLoraFix:
    """The `worker_extension_cls` vLLM mixes into its worker class (it adds no methods)."""


def __getattr__(name: str) -> type:
    if name == "CpuLoraFix":
        install()
        return _CpuLoraFix
    raise AttributeError(name)
