"""Validation of LoRA adapter files before the engine ever sees them.

vLLM's engine core dies for good if `generate()` meets an adapter it cannot load, so every check
that can be done on disk is done here: path containment, config, rank, modules, weights.
Standard library only.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from server.core.errors import AdapterInvalid, InvalidRequest

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,255}$")
SUPPORTED_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)
_MAX_CONFIG_BYTES = 1 << 20
_MAX_HEADER_BYTES = 100 << 20
_WEIGHTS = "adapter_model.safetensors"
_CONFIG = "adapter_config.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseModelShape:
    """What an adapter must fit: the base model's linear layer widths."""

    hidden_size: int
    intermediate_size: int
    kv_width: int

    @classmethod
    def from_model_dir(cls, model_dir: str) -> BaseModelShape | None:
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads", heads))
            head_dim = int(config.get("head_dim") or hidden // heads)
            return cls(
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                kv_width=kv_heads * head_dim,
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def widths(self) -> frozenset[int]:
        return frozenset({self.hidden_size, self.intermediate_size, self.kv_width})


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterRules:
    roots: tuple[str, ...]
    max_rank: int
    base_names: frozenset[str]
    base_shape: BaseModelShape | None = None


def check_name(name: object, rules: AdapterRules) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise InvalidRequest(
            f"Invalid adapter name {str(name)[:64]!r}: use 1-256 letters, digits, '_', '.', '-'",
            param="name",
        )
    if name in rules.base_names:
        raise InvalidRequest(
            f"The lora adapter '{name}' conflicts with a served base model.", param="name"
        )
    return name


def resolve_source(src: object, rules: AdapterRules) -> Path:
    """Resolve `src` (symlinks included) and require it to lie inside an allowed root."""
    if not isinstance(src, str) or not src or "\x00" in src or len(src) > 4096:
        raise AdapterInvalid("The adapter source must be a non-empty path", param="src")
    if ".." in Path(src).parts:
        raise AdapterInvalid(f"Adapter path {src!r} must not contain '..'", param="src")
    resolved = Path(src).resolve()
    if not any(_is_within(resolved, Path(root).resolve()) for root in rules.roots):
        raise AdapterInvalid(
            f"Adapter path {src!r} is outside the allowed adapter roots", param="src"
        )
    if not resolved.is_dir():
        raise AdapterInvalid(f"No adapter found at {src!r}: not a directory", param="src")
    return resolved


def validate_adapter_dir(path: Path, rules: AdapterRules) -> int:
    """Check config and weights of an adapter directory. Returns its rank."""
    config = _read_config(path)
    rank = _check_rank(config, rules.max_rank)
    _check_modules(config)
    _check_weights(path / _WEIGHTS, rules.base_shape)
    return rank


def _is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _read_config(path: Path) -> Mapping[str, object]:
    config_path = path / _CONFIG
    if not config_path.is_file():
        raise AdapterInvalid(f"No adapter found at {path.name!r}: {_CONFIG} is missing")
    if config_path.stat().st_size > _MAX_CONFIG_BYTES:
        raise AdapterInvalid(f"{_CONFIG} is too large")
    try:
        config = json.loads(config_path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterInvalid(f"{_CONFIG} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterInvalid(f"{_CONFIG} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterInvalid(f"Only LoRA adapters are supported, not {config.get('peft_type')!r}")
    if config.get("use_dora"):
        raise AdapterInvalid("vLLM does not yet support DoRA adapters")
    if config.get("modules_to_save"):
        raise AdapterInvalid("vLLM only supports modules_to_save being None")
    return config


def _check_rank(config: Mapping[str, object], max_rank: int) -> int:
    rank = config.get("r")
    pattern = config.get("rank_pattern") or {}
    ranks = [rank, *(pattern.values() if isinstance(pattern, dict) else [])]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in ranks):
        raise AdapterInvalid(f"{_CONFIG} has no valid rank 'r'")
    highest = max(r for r in ranks if isinstance(r, int))
    if highest > max_rank:
        raise AdapterInvalid(f"LoRA rank {highest} is greater than max_lora_rank {max_rank}.")
    return highest


def _check_modules(config: Mapping[str, object]) -> None:
    targets = config.get("target_modules")
    names: Iterable[object] = [targets] if isinstance(targets, str) else (targets or [])
    if not isinstance(names, list | tuple) and not isinstance(targets, str):
        raise AdapterInvalid(f"{_CONFIG} has invalid target_modules")
    unsupported = sorted(str(n) for n in names if n not in SUPPORTED_MODULES)
    if unsupported or not targets:
        raise AdapterInvalid(
            f"Unsupported target modules {unsupported}; supported: {sorted(SUPPORTED_MODULES)}"
        )


def _check_weights(weights: Path, shape: BaseModelShape | None) -> None:
    if not weights.is_file():
        raise AdapterInvalid(f"{_WEIGHTS} is missing (only safetensors adapters are accepted)")
    header = _read_safetensors_header(weights)
    if shape is None:
        return
    for name, meta in header.items():
        dims = meta.get("shape") if isinstance(meta, dict) else None
        if name == "__metadata__" or not isinstance(dims, list) or len(dims) != 2:
            continue
        width = dims[1] if "lora_A" in name else dims[0]
        if width not in shape.widths:
            raise AdapterInvalid(f"Adapter tensor {name} does not fit the base model")


def _read_safetensors_header(weights: Path) -> dict[str, object]:
    size = weights.stat().st_size
    with weights.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise AdapterInvalid(f"{_WEIGHTS} is truncated")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_MAX_HEADER_BYTES, size - 8):
            raise AdapterInvalid(f"{_WEIGHTS} is corrupt: header too large")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise AdapterInvalid(f"{_WEIGHTS} is corrupt: unreadable header") from None
    if not isinstance(header, dict):
        raise AdapterInvalid(f"{_WEIGHTS} is corrupt: header is not an object")
    _check_offsets(header, size - 8 - length)
    return header


def _check_offsets(header: Mapping[str, object], data_bytes: int) -> None:
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise AdapterInvalid(f"{_WEIGHTS} is corrupt: bad offsets for {name}")
