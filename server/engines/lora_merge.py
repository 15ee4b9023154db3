"""The tensor math of composed adapters (server/core/composition.py's `AdapterComposer`).

`linear` is the exact weighted sum of the adapters' weight changes,
ΔW = Σ wᵢ·sᵢ·BᵢAᵢ with sᵢ the scaling vLLM applies to adapter i (αᵢ/rᵢ, αᵢ/√rᵢ with rsLoRA,
per module through rank_pattern/alpha_pattern), built by rank concatenation as peft's
`add_weighted_adapter(..., combination_type="cat")` does: A = [w₁s₁A₁; w₂s₂A₂; …] (rows),
B = [B₁ B₂ …] (columns), so BA = Σ wᵢsᵢBᵢAᵢ, written with r = lora_alpha = Σ rᵢ (scaling 1).
Every module of the union gets the full rank: an input that lacks a module contributes zero
rows and columns to it.

numpy and safetensors only (no torch outside the engine): the inputs were validated by the
registry (server/core/adapter_files.py) before they get here.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from server.core.adapter_files import CONFIG_FILE, WEIGHTS_FILE, read_safetensors_header
from server.core.composition import MergeInput
from server.core.errors import AdapterInvalid

_PEFT_PREFIX = "base_model.model."
_TENSOR_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>[AB])\.weight$")
_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
}
Matrix = np.ndarray[Any, np.dtype[np.floating[Any]]]


@dataclass(frozen=True, slots=True)
class LoraFactors:
    """One module of one adapter: A (rank × in), B (out × rank) and vLLM's scaling of BA."""

    a: Matrix
    b: Matrix
    scaling: float


class NumpyComposer:
    """Writes composed adapters (`AdapterComposer`)."""

    def compose(self, inputs: Sequence[MergeInput], out_dir: Path) -> None:
        adapters = [read_adapter(Path(i.path)) for i in inputs]
        dtype = _common_dtype([dt for _, _, dt in adapters])
        weighted = [
            (modules, i.rank, i.weight)
            for (modules, _, _), i in zip(adapters, inputs, strict=True)
        ]
        tensors = compose_linear(weighted, dtype)
        rank = sum(i.rank for i in inputs)
        config = _composed_config(adapters[0][1], rank, tensors)
        _write_atomically(out_dir, config, tensors, inputs)


def compose_linear(
    adapters: Sequence[tuple[Mapping[str, LoraFactors], int, float]], dtype: np.dtype[Any]
) -> dict[str, Matrix]:
    """(modules, rank, weight) per adapter → the composed tensors by peft name. The result's
    rank is the sum of the ranks; its scaling is 1."""
    total = sum(rank for _, rank, _ in adapters)
    shapes = _module_shapes(adapters)
    tensors: dict[str, Matrix] = {}
    for module, (width_in, width_out) in sorted(shapes.items()):
        a = np.zeros((total, width_in), dtype)
        b = np.zeros((width_out, total), dtype)
        offset = 0
        for modules, rank, weight in adapters:
            factors = modules.get(module)
            if factors is not None:
                r = factors.a.shape[0]
                # peft's order, in the tensors' dtype: (A·w)·s
                a[offset : offset + r] = (factors.a.astype(dtype) * weight) * factors.scaling
                b[:, offset : offset + r] = factors.b.astype(dtype)
            offset += rank
        tensors[f"{_PEFT_PREFIX}{module}.lora_A.weight"] = a
        tensors[f"{_PEFT_PREFIX}{module}.lora_B.weight"] = b
    return tensors


def _module_shapes(
    adapters: Sequence[tuple[Mapping[str, LoraFactors], int, float]],
) -> dict[str, tuple[int, int]]:
    """(in, out) width of every module of the union; inputs must agree on each."""
    shapes: dict[str, tuple[int, int]] = {}
    for modules, _, _ in adapters:
        for module, factors in modules.items():
            shape = (factors.a.shape[1], factors.b.shape[0])
            if shapes.setdefault(module, shape) != shape:
                raise AdapterInvalid(
                    f"The adapters disagree on the shape of {module} ({shapes[module]} and "
                    f"{shape}): they were not trained on one base model",
                    param="merged_adapters.ids",
                )
    return shapes


def read_adapter(
    folder: Path,
) -> tuple[dict[str, LoraFactors], dict[str, Any], np.dtype[Any]]:
    """The LoRA factors of a validated adapter folder by module (peft prefix removed), its
    config and the dtype of its tensors (float32 when bfloat16 or mixed)."""
    if (folder / "new_embeddings.safetensors").exists():
        raise AdapterInvalid(
            f"Adapter {folder.name!r} adds token embeddings: it cannot be merged",
            param="merged_adapters.ids",
        )
    config = json.loads((folder / CONFIG_FILE).read_bytes())
    raw, dtypes = _read_tensors(folder / WEIGHTS_FILE)
    pairs: dict[str, dict[str, Matrix]] = {}
    for key, tensor in raw.items():
        match = _TENSOR_KEY.match(key)
        if match is None:  # validation allows only LoRA factors: never reached
            raise AdapterInvalid(f"Adapter {folder.name!r} has an unexpected tensor {key[:200]!r}")
        module = match.group("module").removeprefix(_PEFT_PREFIX)
        pairs.setdefault(module, {})[match.group("kind")] = tensor
    modules = {
        module: LoraFactors(pair["A"], pair["B"], vllm_scaling(config, module))
        for module, pair in pairs.items()
    }
    return modules, config, _common_dtype(dtypes)


def vllm_scaling(config: Mapping[str, Any], module: str) -> float:
    """The factor vLLM multiplies a module's BA by (its PEFTHelper.get_rank_and_scaling):
    lora_alpha/r, over √r with rsLoRA, with rank_pattern/alpha_pattern overrides matched as
    peft does (a key matches a suffix of the module name at a '.' boundary, first match wins)."""
    rank = _pattern(config.get("rank_pattern"), module)
    alpha = _pattern(config.get("alpha_pattern"), module)
    rank = config["r"] if rank is None else rank
    alpha = config["lora_alpha"] if alpha is None else alpha
    if config.get("use_rslora"):
        return float(alpha / math.sqrt(rank))
    return float(alpha / rank)


def _pattern(pattern: object, module: str) -> Any:
    if not isinstance(pattern, dict):
        return None
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def _read_tensors(weights: Path) -> tuple[dict[str, Matrix], list[np.dtype[Any]]]:
    """Every tensor of a safetensors file as float arrays (bfloat16 widened to float32, which
    is exact), and the file's dtypes."""
    header = read_safetensors_header(weights)  # checked layout: offsets tile the data
    data = weights.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    tensors: dict[str, Matrix] = {}
    dtypes: list[np.dtype[Any]] = []
    for name, meta in header.items():
        if name == "__metadata__" or not isinstance(meta, dict):
            continue
        begin, end = meta["data_offsets"]
        chunk = data[start + begin : start + end]
        shape = tuple(meta["shape"])
        if meta["dtype"] == "BF16":
            widened = np.frombuffer(chunk, "<u2").astype("<u4") << 16
            tensors[name] = widened.view("<f4").reshape(shape)
            dtypes.append(np.dtype("<f4"))
        else:
            dtype = _NUMPY_DTYPES[meta["dtype"]]
            tensors[name] = np.frombuffer(chunk, dtype).reshape(shape)
            dtypes.append(dtype)
    return tensors, dtypes


def _common_dtype(dtypes: Sequence[np.dtype[Any]]) -> np.dtype[Any]:
    kinds = set(dtypes)
    return kinds.pop() if len(kinds) == 1 else np.dtype("<f4")


def _composed_config(
    first: Mapping[str, Any], rank: int, tensors: Mapping[str, Matrix]
) -> dict[str, Any]:
    modules = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in tensors})
    return {
        "peft_type": "LORA",
        "task_type": first.get("task_type"),
        "base_model_name_or_path": first.get("base_model_name_or_path"),
        "r": rank,
        "lora_alpha": rank,  # scaling 1: the inputs' scalings are inside A
        "target_modules": modules,
        "bias": "none",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def _write_atomically(
    out_dir: Path, config: Mapping[str, Any], tensors: dict[str, Matrix],
    inputs: Sequence[MergeInput],
) -> None:
    """Write into a temporary sibling folder, then rename it to `out_dir`: the folder is
    complete or absent. Another process that finished first wins (same key, same content)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        merged_from = [{"name": i.name, "weight": i.weight} for i in inputs]
        save_file(
            {k: np.ascontiguousarray(v) for k, v in tensors.items()},
            str(staging / WEIGHTS_FILE),
            metadata={"format": "pt", "merged_from": json.dumps(merged_from)},
        )
        staging.chmod(0o755)
        try:
            os.rename(staging, out_dir)
        except OSError:
            if not (out_dir / CONFIG_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
