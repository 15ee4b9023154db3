"""A fix for vLLM's CPU LoRA kernels, loaded into vLLM's worker process.

vLLM marks tokens without a LoRA with index -1. The Triton kernels skip them; the PyTorch ops the
CPU platform uses (`vllm/lora/ops/torch_ops/lora_ops.py`) index `weights[-1]` instead, so a
base-model request batched next to LoRA requests silently gets the last engine slot's adapter
applied (measured here: base outputs change whenever LoRA traffic runs at the same time). Upstream
fix: vllm-project/vllm PR #48421 (open when written). This module wraps the three `bgmv_*` ops so
-1 rows are left untouched, exactly as the Triton kernels do; valid rows are computed unchanged.

How it is loaded: `VllmEngineOptions` names `CpuLoraFix` as vLLM's `worker_extension_cls`, which
vLLM resolves inside every worker process (where the model runs) before the model is built.
Resolving that name (module `__getattr__`) installs the wrappers there; importing the module has
no effect, and the gateway's own process never resolves it. vLLM is imported by name at run time
so that only the engine adapter depends on it statically.
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


def install() -> None:
    """Wrap the ops wherever vLLM bound them. Idempotent."""
    modules = [importlib.import_module(name) for name in _MODULES]
    originals = {name: getattr(modules[0], name) for name in _OPS}
    for name, op in originals.items():
        wrapped = op if getattr(op, _MARK, False) else skipping_no_lora_rows(op)
        for module in modules:
            if hasattr(module, name):
                setattr(module, name, wrapped)


class _CpuLoraFix:
    """The `worker_extension_cls` vLLM mixes into its worker class (it adds no methods)."""


def __getattr__(name: str) -> type:
    if name == "CpuLoraFix":
        install()
        return _CpuLoraFix
    raise AttributeError(name)
