"""Validation of LoRA adapter names, paths and files before the engine ever sees them.

vLLM's engine core dies for good if `generate()` meets an adapter it cannot load, so every check
that can be done on disk is done here, mirroring what vLLM's loader would refuse:

- the name (charset, length, not a base model name);
- the path: symlinks resolved, inside an allowed root, no `..`, never /proc, /sys or /dev, a
  directory whose files are regular files that also stay inside the roots;
- `adapter_config.json`: a LoRA config vLLM supports (rank <= max_lora_rank, no DoRA, bias,
  modules_to_save, ...), target modules the base model has;
- `adapter_model.safetensors` (never pickle): a well-formed header whose tensors fit the base
  model's layer widths and layer count, with a rank <= max_lora_rank.

Standard library only. Every failure is an `AdapterInvalid` (4xx) with a message naming the problem.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from server.core.errors import AdapterInvalid, AdapterSourceMissing, InvalidRequest

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,255}$")
SUPPORTED_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)
FORBIDDEN_TREES = ("/proc", "/sys", "/dev")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt")
_MAX_CONFIG_BYTES = 1 << 20
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_MAX_SRC_CHARS = 4096
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_TENSOR_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>[AB])\.weight$")
_LAYER_INDEX = re.compile(r"\blayers\.(\d+)\.")
# PEFT initialisations that vLLM accepts (others rewrite the base weights when applied).
_SUPPORTED_INITS = frozenset({"gaussian", "eva", "orthogonal", "mica", "lora_ga"})


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseModelShape:
    """What an adapter must fit: the base model's linear layer widths and its depth."""

    hidden_size: int
    intermediate_size: int
    q_width: int
    kv_width: int
    num_layers: int | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str) -> BaseModelShape | None:
        """Read a Hugging Face `config.json`; None when it is absent or not Llama-like."""
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or hidden // heads)
            layers = config.get("num_hidden_layers")
            return cls(
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                q_width=heads * head_dim,
                kv_width=kv_heads * head_dim,
                num_layers=int(layers) if layers is not None else None,
            )
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            return None

    def io_widths(self, module: str) -> tuple[int, int]:
        """(input width, output width) of one of the base model's linear layers."""
        hidden, inter = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (hidden, self.q_width),
            "k_proj": (hidden, self.kv_width),
            "v_proj": (hidden, self.kv_width),
            "o_proj": (self.q_width, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }[module]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterRules:
    roots: tuple[str, ...]
    max_rank: int
    base_names: frozenset[str]
    base_shape: BaseModelShape | None = None


def check_name(name: object, rules: AdapterRules) -> str:
    """The name as given if it is a valid adapter name. Raises InvalidRequest (400)."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest("The adapter name is required", param="name")
    if not NAME_PATTERN.match(name):
        raise InvalidRequest(
            f"Invalid adapter name {name[:64]!r}: use 1-256 characters from letters, digits, "
            "'_', '.' and '-', not starting with '.' or '-'",
            param="name",
        )
    if name in rules.base_names:
        raise InvalidRequest(
            f"The lora adapter '{name}' conflicts with a served base model.", param="name"
        )
    return name


def resolve_source(src: object, rules: AdapterRules) -> Path:
    """Resolve `src` (symlinks included) and require a directory inside an allowed root.

    Nothing under the path is opened here; `validate_adapter_dir` does that afterwards.
    """
    if not isinstance(src, str) or not src.strip():
        raise InvalidRequest("The adapter source 'src' is required", param="src")
    if "\x00" in src or len(src) > _MAX_SRC_CHARS:
        raise AdapterInvalid("The adapter source is not a valid path", param="src")
    if ".." in Path(src).parts:
        raise AdapterInvalid(f"Adapter path {src!r} must not contain '..'", param="src")
    if _in_forbidden_tree(os.path.abspath(src)):
        raise AdapterInvalid(f"Adapter path {src!r} points into a system tree", param="src")
    resolved = Path(src).resolve()
    if _in_forbidden_tree(str(resolved)) or not _inside_roots(resolved, rules):
        raise AdapterInvalid(
            f"Adapter path {src!r} is outside the allowed adapter roots", param="src"
        )
    if not resolved.is_dir():
        raise AdapterSourceMissing(f"No adapter found at {src!r}: not a directory", param="src")
    return resolved


def validate_adapter_dir(path: Path, rules: AdapterRules) -> int:
    """Check config and weights of a resolved adapter directory. Returns its rank."""
    config = _read_config(_regular_file(path, CONFIG_FILE, rules, missing=_no_config))
    rank = _check_rank(config, rules.max_rank)
    _check_alpha(config)
    _check_target_modules(config)
    weights = _regular_file(path, WEIGHTS_FILE, rules, missing=_no_weights)
    _check_weights(weights, rules)
    return rank


def _inside_roots(path: Path, rules: AdapterRules) -> bool:
    return any(_is_within(path, Path(root).resolve()) for root in rules.roots)


def _is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _in_forbidden_tree(path: str) -> bool:
    return any(path == tree or path.startswith(tree + "/") for tree in FORBIDDEN_TREES)


def _no_config(path: Path) -> AdapterInvalid:
    return AdapterSourceMissing(f"No adapter found in {path.name!r}: {CONFIG_FILE} is missing")


def _no_weights(path: Path) -> AdapterInvalid:
    pickles = [name for name in PICKLE_FILES if (path / name).exists()]
    if pickles:
        return AdapterInvalid(
            f"Adapter {path.name!r} has only pickle weights ({pickles[0]}); only safetensors "
            f"adapters are accepted: convert it to {WEIGHTS_FILE}"
        )
    return AdapterInvalid(
        f"Adapter {path.name!r} has no {WEIGHTS_FILE} (only safetensors adapters are accepted)"
    )


def _regular_file(
    folder: Path, name: str, rules: AdapterRules, *, missing: Callable[[Path], AdapterInvalid]
) -> Path:
    """The file `name` in `folder`: must exist, be a regular file and resolve inside the roots."""
    candidate = folder / name
    if not candidate.exists() and not candidate.is_symlink():
        raise missing(folder)
    resolved = candidate.resolve()
    if _in_forbidden_tree(str(resolved)) or not _inside_roots(resolved, rules):
        raise AdapterInvalid(f"{name} of adapter {folder.name!r} links outside the adapter roots")
    try:
        mode = resolved.stat().st_mode
    except OSError:
        raise missing(folder) from None
    if not stat.S_ISREG(mode):
        raise AdapterInvalid(f"{name} of adapter {folder.name!r} is not a regular file")
    return resolved


def _read_config(config_path: Path) -> Mapping[str, object]:
    if config_path.stat().st_size > _MAX_CONFIG_BYTES:
        raise AdapterInvalid(f"{CONFIG_FILE} is too large")
    try:
        config = json.loads(config_path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterInvalid(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterInvalid(f"{CONFIG_FILE} must hold a JSON object")
    missing = [key for key in ("r", "lora_alpha", "target_modules") if key not in config]
    if missing:
        raise AdapterInvalid(f"{CONFIG_FILE} lacks required fields: {', '.join(missing)}")
    problems = _unsupported_features(config)
    if problems:
        raise AdapterInvalid(" ".join(problems))
    return config


def _unsupported_features(config: Mapping[str, object]) -> list[str]:
    """The same refusals as vLLM's PEFTHelper, so the engine never has to make them."""
    checks = [
        (
            config.get("peft_type", "LORA") != "LORA",
            f"Only LoRA adapters are supported, not {config.get('peft_type')!r}.",
        ),
        (bool(config.get("use_dora")), "vLLM does not yet support DoRA."),
        (bool(config.get("modules_to_save")), "vLLM only supports modules_to_save being None."),
        (bool(config.get("lora_bias")), "vLLM does not support LoRA bias (lora_bias)."),
        (config.get("bias", "none") != "none", "Adapter bias is not supported."),
        (bool(config.get("alora_invocation_tokens")), "Activated LoRA (aLoRA) is not supported."),
        (bool(config.get("layer_replication")), "layer_replication is not supported."),
        (bool(config.get("use_bdlora")), "Block-diagonal LoRA is not supported."),
        (bool(config.get("use_qalora")), "QALoRA is not supported."),
        (
            _unsupported_init(config.get("init_lora_weights", True)),
            f"init_lora_weights={config.get('init_lora_weights')!r} is not supported.",
        ),
    ]
    return [message for failed, message in checks if failed]


def _unsupported_init(init: object) -> bool:
    return isinstance(init, str) and init.lower() not in _SUPPORTED_INITS


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_alpha(config: Mapping[str, object]) -> None:
    """`lora_alpha` and every `alpha_pattern` value must be finite numbers: vLLM's worker divides
    them by the rank (a string fails there, after the checks), and NaN or an infinity scales the
    adapter's every output to NaN."""
    alphas = _with_pattern(config, "lora_alpha", "alpha_pattern")
    if not all(finite_number(alpha) for alpha in alphas):
        raise AdapterInvalid(f"{CONFIG_FILE}: 'lora_alpha' must be a finite number")


def finite_number(value: object) -> bool:
    """An int or float (not a bool) that is finite as a float."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        return False


def _with_pattern(config: Mapping[str, object], key: str, pattern_key: str) -> list[object]:
    """`config[key]` and every per-module override of it in `config[pattern_key]`."""
    pattern = config.get(pattern_key) or {}
    if not isinstance(pattern, dict):
        raise AdapterInvalid(f"{CONFIG_FILE} has an invalid {pattern_key}")
    return [config.get(key), *pattern.values()]


def _check_rank(config: Mapping[str, object], max_rank: int) -> int:
    ranks = _with_pattern(config, "r", "rank_pattern")
    if not all(_positive_int(r) for r in ranks):
        raise AdapterInvalid(f"{CONFIG_FILE}: the LoRA rank 'r' must be a positive integer")
    highest = max(r for r in ranks if isinstance(r, int))
    if highest > max_rank:
        raise AdapterInvalid(f"LoRA rank {highest} is greater than max_lora_rank {max_rank}.")
    return highest


def _check_target_modules(config: Mapping[str, object]) -> None:
    targets = config.get("target_modules")
    if isinstance(targets, str):
        return  # a PEFT regex or "all-linear": the tensor names are checked instead
    if not isinstance(targets, list) or not targets:
        raise AdapterInvalid(f"{CONFIG_FILE} has invalid target_modules")
    unsupported = sorted({str(t) for t in targets if t not in SUPPORTED_MODULES})
    if unsupported:
        raise AdapterInvalid(
            f"Unsupported target modules {unsupported}; supported: {sorted(SUPPORTED_MODULES)}"
        )


def _check_weights(weights: Path, rules: AdapterRules) -> None:
    header = read_safetensors_header(weights)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if not tensors:
        raise AdapterInvalid(f"{WEIGHTS_FILE} holds no tensors")
    ranks: dict[str, dict[str, int]] = {}
    for key, meta in tensors.items():
        module, kind, shape = _lora_tensor(key, meta, rules.base_shape)
        ranks.setdefault(module, {})[kind] = shape[0] if kind == "A" else shape[1]
    for module, pair in ranks.items():
        if set(pair) != {"A", "B"} or pair["A"] != pair["B"]:
            raise AdapterInvalid(f"{WEIGHTS_FILE}: {module} needs lora_A and lora_B of one rank")
        if pair["A"] < 1:
            raise AdapterInvalid(f"{WEIGHTS_FILE}: {module} has LoRA rank {pair['A']}")
        if pair["A"] > rules.max_rank:
            raise AdapterInvalid(
                f"LoRA rank {pair['A']} is greater than max_lora_rank {rules.max_rank}."
            )


def _lora_tensor(
    key: str, meta: object, shape_of_base: BaseModelShape | None
) -> tuple[str, str, list[int]]:
    """Check one tensor entry; returns (module path, "A" or "B", shape)."""
    match = _TENSOR_KEY.match(key)
    module = match.group("module") if match else ""
    base_module = module.rsplit(".", 1)[-1]
    if match is None or base_module not in SUPPORTED_MODULES:
        raise AdapterInvalid(f"{WEIGHTS_FILE}: unexpected tensor {key[:200]!r}")
    shape = meta.get("shape") if isinstance(meta, dict) else None
    if not isinstance(shape, list) or len(shape) != 2:
        raise AdapterInvalid(f"{WEIGHTS_FILE}: tensor {key[:200]!r} is not a matrix")
    kind = match.group("kind")
    if shape_of_base is not None:
        _check_fits(key, module, kind, shape, shape_of_base)
    return module, kind, shape


def _check_fits(key: str, module: str, kind: str, shape: list[int], base: BaseModelShape) -> None:
    width_in, width_out = base.io_widths(module.rsplit(".", 1)[-1])
    fits = shape[1] == width_in if kind == "A" else shape[0] == width_out
    layer = _LAYER_INDEX.search(module + ".")
    if layer is not None and base.num_layers is not None and int(layer.group(1)) >= base.num_layers:
        fits = False
    if not fits:
        raise AdapterInvalid(
            f"Adapter tensor {key[:200]!r} with shape {shape} does not fit the base model"
        )


def read_safetensors_header(weights: Path) -> dict[str, object]:
    """Parse and check a safetensors header without loading any tensor."""
    size = weights.stat().st_size
    with weights.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise AdapterInvalid(f"{WEIGHTS_FILE} is corrupt: truncated")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_MAX_HEADER_BYTES, size - 8):
            raise AdapterInvalid(f"{WEIGHTS_FILE} is corrupt: header too large")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise AdapterInvalid(f"{WEIGHTS_FILE} is corrupt: unreadable header") from None
    if not isinstance(header, dict):
        raise AdapterInvalid(f"{WEIGHTS_FILE} is corrupt: header is not an object")
    _check_layout(header, size - 8 - length)
    return header


def _check_layout(header: Mapping[str, object], data_bytes: int) -> None:
    """Offsets must tile the data section exactly, each tensor sized by dtype and shape."""
    spans: list[tuple[int, int]] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        spans.append(_span(name, meta))
    end = 0
    for start, stop in sorted(spans):
        if start != end:
            raise AdapterInvalid(f"{WEIGHTS_FILE} is corrupt: tensors overlap or leave gaps")
        end = stop
    if end != data_bytes:
        raise AdapterInvalid(f"{WEIGHTS_FILE} is corrupt: data section has the wrong size")


def _span(name: str, meta: object) -> tuple[int, int]:
    if not isinstance(meta, dict):
        raise AdapterInvalid(f"{WEIGHTS_FILE} is corrupt: bad entry for {name[:200]!r}")
    offsets, shape, dtype = meta.get("data_offsets"), meta.get("shape"), meta.get("dtype")
    if dtype not in _DTYPE_BYTES:
        raise AdapterInvalid(f"{WEIGHTS_FILE}: unsupported dtype {str(dtype)[:16]!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
        or not isinstance(shape, list)
        or not all(isinstance(d, int) and d >= 0 for d in shape)
    ):
        raise AdapterInvalid(f"{WEIGHTS_FILE} is corrupt: bad entry for {name[:200]!r}")
    start, stop = offsets
    if stop - start != math.prod(shape) * _DTYPE_BYTES[str(dtype)]:
        raise AdapterInvalid(f"{WEIGHTS_FILE} is corrupt: size mismatch for {name[:200]!r}")
    return start, stop


# ---- identity by content ---------------------------------------------------------------------
# The files vLLM's LoRA loader reads: an adapter is these bytes, whatever its name or folder.
CONTENT_FILES = (CONFIG_FILE, WEIGHTS_FILE, "new_embeddings.safetensors")
_CHUNK = 1 << 20
READ_ATTEMPTS = 3  # reads of files that change meanwhile before they are refused
Fingerprint = tuple[tuple[str, int, int, int], ...]


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """A validated adapter directory and what identifies its contents."""

    path: Path
    rank: int
    digest: str  # sha256 of the content files (names, lengths, bytes)
    fingerprint: Fingerprint  # cheap stat of the same files: a change means re-digest


def inspect_adapter(src: object, rules: AdapterRules) -> AdapterFiles:
    """Resolve, validate and digest an adapter source (reads every content file: call it off
    the event loop).

    Files written in place while they are read (a trainer saving into the served folder,
    `rsync --inplace`) can be a valid adapter with part old, part new weights at every
    moment: the read counts only if the files' fingerprint is the same before and after it,
    and the fingerprint kept is the one from before, so a write that ends later is a change
    the next use sees. A read that keeps overlapping writes is refused (the files are not one
    adapter yet). A writer pausing between parts of a file is not seen: each pause leaves a
    valid adapter on disk (README: rename a new file into place instead)."""
    path = resolve_source(src, rules)
    for _ in range(READ_ATTEMPTS):
        before = fingerprint(path)
        rank = validate_adapter_dir(path, rules)
        digest = content_digest(path)
        if fingerprint(path) == before:
            return AdapterFiles(path, rank, digest, before)
    raise AdapterInvalid(
        f"Adapter {path.name!r} kept changing while its files were read: try again once "
        "they are written"
    )


def fingerprint(path: Path) -> Fingerprint:
    """(name, size, mtime_ns, inode) of each content file present; () if none can be read."""
    found = []
    for name in CONTENT_FILES:
        try:
            info = os.stat(path / name)
        except OSError:
            continue
        found.append((name, info.st_size, info.st_mtime_ns, info.st_ino))
    return tuple(found)


def content_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for name in CONTENT_FILES:
        file = path / name
        if not file.is_file():
            continue
        digest.update(name.encode() + b"\0" + str(file.stat().st_size).encode() + b"\0")
        with file.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()
