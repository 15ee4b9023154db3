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
LoRA-A product for all of a layer's slices in one matrix multiply, zeroes each token's row
outside its own slot's columns, and multiplies by every slot's LoRA-B in one more (33 % of the
step after the first fused version; LoRA work per unit of base matrix work about 5.2 -> 2.6;
bench/ANALYSIS.md). The embedding and logits LoRA
(`add_lora_embedding`, `add_lora_logits`) are done the same way, and the per-step
`update_metadata` maps slots in one list pass and leaves the prefill run metadata, which only
vLLM's own methods read, until it is read. A layer that no loaded adapter changes (every slot's B
zero: vLLM zeroes a slot's weights for each module its adapter leaves out, and PEFT's default
targets only q_proj and v_proj, leaving o_proj, the MLP, the embedding and the logits) adds
nothing and is skipped. Base rows (-1) get nothing added; any other shape or
mode goes to vLLM's own method (which runs on the wrapped ops above).

The KV cache gets only finite keys and values (`finite_kv_cache_update`). An adapter whose
weights are huge (a merge weighted 1e30 through `merged_adapters`) or not finite makes its own
request's activations overflow, and the NaN or infinite keys and values it writes stay in the
cache blocks after it ends. The CPU attention kernel reads a block's slots past a sequence's end
with zero weight, and zero times NaN is NaN: the next requests given those blocks, base or any
adapter, answered empty or garbled text (measured: 20 of 24 requests after such a merge). Each
layer's keys and values are checked with one sum before they are cached; a sum that is not
finite (NaN, an infinity, or an overflow) has them written with zeros in place of NaN and
infinities. The request that overflowed answers garbage; no other request sees it.

How it is loaded: `VllmEngineOptions` names `CpuLoraFix` as vLLM's `worker_extension_cls`, which
vLLM resolves inside every worker process (where the model runs) before the model is built.
Resolving that name (module `__getattr__`) installs the wrappers and the fused methods there;
importing the module has no effect, and the gateway's own process never resolves it. vLLM and
torch are imported by name at run time so that only the engine adapter depends on vLLM
statically.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, cast

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
    """`PunicaWrapperCPU.add_lora_linear` in four torch calls instead of ~20 per slice: every
    slot's LoRA-A product for all slices in one matrix multiply, each token's row zeroed outside
    its own slot's columns, then one multiply by every slot's B (block-diagonal over the slices)
    added to y. Rows without a LoRA (-1) get nothing added, as with the fixed ops. Anything
    unusual, or weights that are not finite, go to vLLM's own method."""
    indices = wrapper.token_lora_indices
    weights = None
    if wrapper.is_prefill and kw.get("buffer") is None and lora_a_stacked:
        weights = _weights(lora_a_stacked, lora_b_stacked, y.dtype)
    width = sum(output_slices)
    if weights is None or weights.widths != tuple(output_slices) or not _rows_fit(
        y, x, indices, weights.inputs, width
    ):
        _ORIGINAL["add_lora_linear"](
            wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kw)
        return
    if wrapper.no_lora or weights.zero:
        return
    rows = _step_rows(wrapper, indices, _TOKENS)
    rows.add_own(y, rows.shrink_own(x, weights, scale), weights, width)


def fused_add_lora_embedding(
    wrapper: Any, y: Any, x: Any, lora_b_stacked: Any, add_inputs: bool = True, **kw: Any,
) -> None:
    """`PunicaWrapperCPU.add_lora_embedding` (y += x @ each token's slot's B) in one matrix
    multiply over every slot instead of vLLM's per-token weight gather: x repeated for every
    slot, zero outside the token's own. Same rows as vLLM's prefill path (whose per-run indices
    expand to exactly the token indices), -1 rows left untouched; decode mode, assignment
    (`add_inputs` false), other shapes and weights that are not finite go to vLLM."""
    indices = wrapper.token_lora_indices
    weights = None
    if wrapper.is_prefill and add_inputs:
        weights = _weights((), (lora_b_stacked,), y.dtype)
    if weights is None or not _rows_fit(y, x, indices, weights.inputs, 0):
        _ORIGINAL["add_lora_embedding"](wrapper, y, x, lora_b_stacked, add_inputs, **kw)
        return
    if wrapper.no_lora or weights.zero:
        return
    rows = _step_rows(wrapper, indices, _TOKENS)
    spread = rows.own(x.repeat(1, weights.slots), weights.slots, 1.0)
    rows.add_own(y, spread, weights, min(weights.widths[0], y.shape[1]))


def fused_add_lora_logits(
    wrapper: Any, y: Any, x: Any, lora_a_stacked: Any, lora_b_stacked: Any, scale: float,
    **kw: Any,
) -> None:
    """`PunicaWrapperCPU.add_lora_logits` (y += (x @ A) * scale @ B per sampled row's slot) in
    two matrix multiplies over every slot, float32 in between as in vLLM; -1 rows untouched.
    A caller's `buffer`, other shapes and weights that are not finite go to vLLM's own
    method."""
    indices = wrapper.sampler_indices
    y_rows, x_rows = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
    weights = None
    if kw.get("buffer") is None:
        weights = _weights((lora_a_stacked,), (lora_b_stacked,), y.dtype)
    if weights is None or not _rows_fit(y_rows, x_rows, indices, weights.inputs, 0):
        _ORIGINAL["add_lora_logits"](wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, **kw)
        return
    if weights.zero or bool((indices < 0).all()):
        return
    rows = _step_rows(wrapper, indices, _SAMPLED)
    # the adapter's outputs and the layer's may be padded differently (the logits to the
    # padded vocabulary): vLLM's expand adds to the common part
    rows.add_own(y_rows, rows.shrink_own(x_rows, weights, scale), weights,
                 min(weights.widths[0], y_rows.shape[1]))


def _rows_fit(y: Any, x: Any, indices: Any, inputs: int, width: int) -> bool:
    """One row of x and y and one index per row, x of `inputs` columns, y of `width` or more."""
    return bool(
        x.dim() == 2 and y.dim() == 2 and x.shape[0] == y.shape[0] == indices.shape[0]
        and x.shape[1] == inputs and y.shape[1] >= width
    )


class _Weights:
    """A layer's LoRA weights for every slot, as two matrices: `a`, every slot's A for every
    slice (slots * slices * rank x in, float32, slot by slot); `b`, every slot's B with the rows
    in the same order, each slot's block-diagonal over the slices (slice i's outputs read only
    slice i's part of the shrunk row). A row shrunk to zero outside its own slot's columns
    times `b` is its own slot's LoRA for every slice, in one product."""

    def __init__(self, torch: Any, lora_a: tuple[Any, ...], lora_b: tuple[Any, ...],
                 dtype: Any) -> None:
        self.usable = _plain(lora_a, lora_b)
        if not self.usable:
            return
        first = lora_b[0]
        self.slots, _, _, rank = first.shape
        self.widths = tuple(int(b.shape[2]) for b in lora_b)  # each slice's outputs
        self.width = rank * len(lora_b)  # each slot's columns of a shrunk row
        self.inputs = int(lora_a[0].shape[3]) if lora_a else rank  # x's columns
        self.a: Any = None  # the embedding's A is looked up per token: it has none here
        if lora_a:
            side_by_side = torch.cat(lora_a, dim=-2) if len(lora_a) > 1 else lora_a[0]
            self.a = side_by_side.to(dtype=torch.float32).reshape(-1, self.inputs).t()
        block = first.new_zeros(self.slots, self.width, sum(self.widths), dtype=dtype)
        offset = 0
        for index, (b, width) in enumerate(zip(lora_b, self.widths, strict=True)):
            block[:, index * rank : (index + 1) * rank, offset : offset + width] = (
                b[:, 0].transpose(1, 2))
            offset += width
        self.b = block.reshape(self.slots * self.width, sum(self.widths))
        self.usable = bool(torch.isfinite(self.b).all())
        # no loaded adapter changes this layer (vLLM zeroes a slot's weights for a module its
        # adapter leaves out, and PEFT's default targets only q_proj and v_proj): adding its
        # product would add zeros
        self.zero = not bool(self.b.any())


def _weights(lora_a: tuple[Any, ...], lora_b: tuple[Any, ...], dtype: Any) -> _Weights | None:
    """The layer's `_Weights`, made once per contents; None if a B weight is not finite: zero
    times NaN or infinity is NaN, and one adapter's weights must never reach another's rows."""
    made = _kept((*lora_b, *lora_a), lambda: _Weights(_torch(), lora_a, lora_b, dtype))
    return made if made.usable else None


def _kept(tensors: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """`make()` from `tensors`, made once per contents and kept on the first tensor: vLLM writes
    an adapter's weights into these tensors in place (`copy_`, which moves their version), so
    the tensors and their versions name the contents."""
    key = tuple((id(t), t._version) for t in tensors)
    made = tensors[0].__dict__.get(_KEPT)
    if made is None or made[0] != key:
        made = tensors[0].__dict__[_KEPT] = (key, make())
    return made[1]


@functools.cache
def _torch() -> Any:
    return importlib.import_module("torch")


def _step_rows(wrapper: Any, indices: Any, which: int) -> _Rows:
    """This step's rows of the token (`_TOKENS`) or sampled (`_SAMPLED`) indices: made once by
    `fast_update_metadata` for every layer of the step, else from `indices`."""
    made = wrapper.__dict__.get(_ROWS)
    if made is not None and made[which].count == indices.shape[0]:
        return cast("_Rows", made[which])
    return _Rows(_torch(), indices)


class _Rows:
    """One step's rows and their slots (-1: no LoRA), for products over every slot at once."""

    def __init__(self, torch: Any, indices: Any) -> None:
        self.torch = torch
        self.indices = indices
        self.count = indices.shape[0]
        self._masks: dict[tuple[int, int], Any] = {}

    def shrink_own(self, x: Any, weights: _Weights, scale: float) -> Any:
        """x @ every slot's A * scale in float32, each row kept only in its own slot's columns
        (zero elsewhere, and everywhere for -1 rows)."""
        shrunk = x.to(dtype=self.torch.float32) @ weights.a
        return self.own(shrunk, weights.slots, scale)

    def own(self, values: Any, slots: int, scale: float) -> Any:
        """`values` (rows x slots * width) zeroed outside each row's own slot's columns, in
        place, times `scale`."""
        values.masked_fill_(self._not_own(slots, values.shape[1] // slots), 0.0)
        if scale != 1.0:
            values.mul_(scale)
        return values

    def _not_own(self, slots: int, width: int) -> Any:
        """rows x (slots * width): True where a column belongs to another slot than the row's."""
        made = self._masks.get((slots, width))
        if made is None:
            column_slot = self.torch.arange(slots * width) // width
            made = self._masks[(slots, width)] = column_slot[None, :] != self.indices[:, None]
        return made

    @staticmethod
    def add_own(y: Any, own: Any, weights: _Weights, width: int) -> None:
        """y[:, :width] += own @ every slot's B (its first `width` outputs), in y's dtype, as
        one in-place multiply-add (`y[:, :width] += ...` would also copy the sum onto itself)."""
        b = weights.b if weights.b.shape[1] == width else weights.b[:, :width]
        target = y if y.shape[1] == width else y[:, :width]
        target.addmm_(own.to(dtype=y.dtype), b)


def fast_update_metadata(
    wrapper: Any, mapping: Any, lora_index_to_id: list[int | None], max_loras: int,
    vocab_size: int, **kw: Any,
) -> None:
    """`PunicaWrapperBase.update_metadata` (run once per model step) with the same tensors:
    the token and sampler slot indices mapped in one list pass each instead of vLLM's
    per-token loop, and the prefill run metadata (`compute_meta`: unique runs, two host
    syncs) left until something reads `prefill_metadata` (only vLLM's own methods do, on
    fallback); `no_lora` is set at once. vLLM's decode mode (not used by its V1 runner) and
    an unknown adapter id go to vLLM's method, which raises as before."""
    slot_of = {lora_id: slot for slot, lora_id in enumerate(lora_index_to_id)
               if lora_id is not None}
    try:
        tokens = [slot_of[lora_id] if lora_id > 0 else -1 for lora_id in mapping.index_mapping]
        prompts = [slot_of[lora_id] if lora_id > 0 else -1 for lora_id in mapping.prompt_mapping]
    except KeyError:
        tokens = []
    if not (tokens and mapping.is_prefill):
        wrapper.__dict__.pop(_ROWS, None)
        _lazy_prefill_metadata(wrapper)  # vLLM keeps the last prefill's runs; settle them first
        _ORIGINAL["update_metadata"](
            wrapper, mapping, lora_index_to_id, max_loras, vocab_size, **kw)
        return
    torch = importlib.import_module("torch")
    count, prompt_count = len(tokens), len(prompts)
    token_slots = torch.tensor(tokens, dtype=torch.long)
    prompt_slots = torch.tensor(prompts, dtype=torch.long)
    wrapper._token_lora_indices[:count].copy_(token_slots)
    wrapper._embeddings_indices[:count].copy_(token_slots.clamp(min=0) * vocab_size)
    wrapper._sampler_indices[:prompt_count].copy_(prompt_slots)
    padded = torch.where(prompt_slots == -1, max_loras - 1, prompt_slots) * prompt_count
    wrapper._sampler_indices_padded[:prompt_count].copy_(padded + torch.arange(prompt_count))
    wrapper.indices_len[:] = [count, prompt_count, prompt_count, count]
    wrapper.is_prefill = True
    wrapper.no_lora = max(tokens) < 0
    wrapper.__dict__[_STALE] = True
    wrapper.__dict__[_ROWS] = (_Rows(torch, token_slots), _Rows(torch, prompt_slots))


def _lazy_prefill_metadata(wrapper: Any) -> Any:
    """`prefill_metadata`, computing the run metadata the step's fast update left out."""
    if wrapper.__dict__.pop(_STALE, False):
        wrapper._update_prefill_metadata(wrapper.token_lora_indices)
    base = importlib.import_module("vllm.lora.punica_wrapper.punica_base").PunicaWrapperBase
    return base.prefill_metadata.fget(wrapper)


def finite_kv_cache_update(
    impl: Any, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any
) -> None:
    """`CPUAttentionBackendImpl.do_kv_cache_update` writing only finite keys and values."""
    if not bool(_torch().isfinite(key.sum() + value.sum())):
        key = key.nan_to_num(0.0, 0.0, 0.0)
        value = value.nan_to_num(0.0, 0.0, 0.0)
    _ORIGINAL["do_kv_cache_update"](impl, layer, key, value, kv_cache, slot_mapping)


def _plain(lora_a: tuple[Any, ...], lora_b: tuple[Any, ...]) -> bool:
    """Every B of slots x 1 x (its output width) x rank, and every A (if any, one per B) of
    slots x 1 x rank x in, with the same slots, rank and in."""
    shapes = [tuple(b.shape) for b in lora_b]
    if not shapes or any(len(shape) != 4 or shape[1] != 1 for shape in shapes):
        return False
    slots, _, _, rank = shapes[0]
    if any((shape[0], shape[3]) != (slots, rank) for shape in shapes):
        return False
    if not lora_a:
        return True
    shape_a = tuple(lora_a[0].shape)
    return len(lora_a) == len(lora_b) and len(shape_a) == 4 and shape_a[:3] == (
        slots, 1, rank) and all(tuple(a.shape) == shape_a for a in lora_a)


_CPU_ATTENTION = "vllm.v1.attention.backends.cpu_attn"
_STALE = "_gateway_prefill_metadata_stale"
_ROWS = "_gateway_step_rows"  # (token rows, sampled rows) of the step fast_update_metadata set
_TOKENS, _SAMPLED = 0, 1
_KEPT = "_gateway_kept"  # on a layer's first A or B tensor: (its slices' contents, what _kept made)
_ORIGINAL: dict[str, Callable[..., None]] = {}  # vLLM's own methods, by name
_FUSED: dict[str, Callable[..., None]] = {
    "update_metadata": fast_update_metadata,
    "add_lora_linear": fused_add_lora_linear,
    "add_lora_embedding": fused_add_lora_embedding,
    "add_lora_logits": fused_add_lora_logits,
}


def install() -> None:
    """Wrap the ops wherever vLLM bound them, and fuse the CPU wrapper's LoRA methods.
    Idempotent."""
    modules = [importlib.import_module(name) for name in _MODULES]
    originals = {name: getattr(modules[0], name) for name in _OPS}
    for name, op in originals.items():
        wrapped = op if getattr(op, _MARK, False) else skipping_no_lora_rows(op)
        for module in modules:
            if hasattr(module, name):
                setattr(module, name, wrapped)
    cpu = importlib.import_module(_MODULES[2]).PunicaWrapperCPU
    for name, fused in _FUSED.items():
        if name not in _ORIGINAL:
            _ORIGINAL[name] = getattr(cpu, name)
            setattr(cpu, name, fused)
    if "prefill_metadata" not in vars(cpu):
        cpu.prefill_metadata = property(_lazy_prefill_metadata)
    attention = importlib.import_module(_CPU_ATTENTION).CPUAttentionBackendImpl
    if "do_kv_cache_update" not in _ORIGINAL:
        _ORIGINAL["do_kv_cache_update"] = attention.do_kv_cache_update
        attention.do_kv_cache_update = finite_kv_cache_update


class _CpuLoraFix:
    """The `worker_extension_cls` vLLM mixes into its worker class (it adds no methods)."""


def __getattr__(name: str) -> type:
    if name == "CpuLoraFix":
        install()
        return _CpuLoraFix
    raise AttributeError(name)
