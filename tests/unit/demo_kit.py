"""Torch-free stand-ins for the demo model's files, for the unit tier (which must run with torch
and vllm unimportable): a model folder holding only `config.json`, and small valid LoRA adapters
(PEFT layout, zero weights) that fit it. The fake engine never reads weights."""

from __future__ import annotations

import functools
import json
import struct
import tempfile
from pathlib import Path
from typing import Any

from server.core.adapter_files import BaseModelShape

# hidden 16, 2 heads of 8 (q 16), 1 KV head (kv 8), MLP 32, 2 layers
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
    "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 8, "num_hidden_layers": 2, "vocab_size": 1000,
}
SHAPE = BaseModelShape(hidden_size=16, intermediate_size=32, q_width=16, kv_width=8, num_layers=2)
WIDTHS = {"q_proj": (16, 16), "k_proj": (16, 8), "v_proj": (16, 8), "o_proj": (16, 16),
          "gate_proj": (16, 32), "up_proj": (16, 32), "down_proj": (32, 16)}


def write_adapter(
    folder: Path, *, rank: int = 8, modules: tuple[str, ...] = ("q_proj", "v_proj"),
    layers: int = 2, config: dict[str, Any] | None = None, tensor_rank: int | None = None,
) -> Path:
    """A small valid LoRA adapter (PEFT layout, zero weights) fitting SHAPE. Its config names
    the folder (`revision`), so adapters in different folders have different contents."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": list(modules),
           "bias": "none", "base_model_name_or_path": "tiny", "revision": folder.name}
    cfg.update(config or {})
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    r = tensor_rank or rank
    tensors: dict[str, list[int]] = {}
    for layer in range(layers):
        for module in modules:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            width_in, width_out = WIDTHS[module]
            tensors[f"{prefix}.lora_A.weight"] = [r, width_in]
            tensors[f"{prefix}.lora_B.weight"] = [width_out, r]
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    return folder


def write_safetensors(path: Path, tensors: dict[str, list[int]]) -> None:
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in tensors.items():
        size = shape[0] * shape[1] * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


@functools.cache
def unit_demo() -> Path:
    """A demo folder laid out as `make demo` lays it out: model/, adapters/a1..a3 and
    test-adapters/a4..a12. Built once per test process, in a temporary folder."""
    root = Path(tempfile.mkdtemp(prefix="unit-demo-"))
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(MODEL_CONFIG))
    for name in ("a1", "a2", "a3"):
        write_adapter(root / "adapters" / name)
    for index in range(4, 13):
        write_adapter(root / "test-adapters" / f"a{index}")
    return root


# The demo model's sampling defaults (server/dev/demo_model.py writes the same values).
DEMO_GENERATION_CONFIG = {
    "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
    "repetition_penalty": 1.05, "max_new_tokens": 64, "eos_token_id": 2,
}


def model_with_defaults(generation_config: dict[str, Any] | None = None) -> Path:
    """A model folder like `unit_demo()`'s plus a `generation_config.json` (the model's
    sampling defaults, read by the fake engine as vLLM reads them)."""
    folder = Path(tempfile.mkdtemp(prefix="unit-defaults-"))
    (folder / "config.json").write_text(json.dumps(MODEL_CONFIG))
    config = DEMO_GENERATION_CONFIG if generation_config is None else generation_config
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder
