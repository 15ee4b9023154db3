"""Sampling knobs of the Triton routes → `Sampling`, under both names clients use.

Triton's vLLM backend reads vLLM `SamplingParams` field names (`max_tokens`, `temperature`,
`top_p`, `top_k`, `ignore_eos`, `stop`, `lora_name`, …) from the `sampling_parameters` JSON tensor
or from the request parameters; MindIE's Triton routes use TGI-style names (`max_new_tokens`,
`do_sample`, `repetition_penalty`, `seed`, `details`, …). Both spellings are accepted everywhere.

`priority` and `batch_size` are accepted and not applied (vLLM's priority scheduling is off).
Like the vLLM backend, numbers may arrive as strings (`"max_tokens": "32"`): Triton request
parameters are often strings. The `sampling_parameters` tensor is strict (an unknown key is an
error, as `SamplingParams(**params)` is in the backend); request parameters are lenient, because
Triton carries client-level parameters there too (`binary_data_output`, `sequence_id`, …).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from server.core.errors import InvalidRequest
from server.core.types import Sampling
from server.http.context import RequestBounds

INT64_MAX = 2**63 - 1


def _show(raw: object) -> str:
    text = repr(raw)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(name: str, raw: object) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    if isinstance(raw, str) and raw.strip().lstrip("-").isdigit():
        return int(raw)
    raise InvalidRequest(f"parameter '{name}' must be an integer, got {_show(raw)}", param=name)


def _float(name: str, raw: object) -> float:
    value: float | None = None
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw)
        except ValueError:
            value = None
    if value is None or not math.isfinite(value):
        raise InvalidRequest(
            f"parameter '{name}' must be a finite number, got {_show(raw)}", param=name
        )
    return value


def to_bool(name: str, raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    raise InvalidRequest(f"parameter '{name}' must be a boolean, got {_show(raw)}", param=name)


def _str(name: str, raw: object) -> str:
    if isinstance(raw, str):
        return raw
    raise InvalidRequest(f"parameter '{name}' must be a string, got {_show(raw)}", param=name)


def _stop(name: str, raw: object) -> tuple[str, ...]:
    if isinstance(raw, str):
        return (raw,)
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return tuple(raw)
    raise InvalidRequest(f"parameter '{name}' must be a string or a list of strings", param=name)


def _int_list(name: str, raw: object) -> tuple[int, ...]:
    if isinstance(raw, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        return tuple(raw)
    raise InvalidRequest(f"parameter '{name}' must be a list of integers", param=name)


Convert = Callable[[str, object], Any]

# wire name → (knob, converter). Knobs named like `Sampling` fields go straight into it.
KNOBS: dict[str, tuple[str, Convert]] = {
    "max_tokens": ("max_new_tokens", _int), "max_new_tokens": ("max_new_tokens", _int),
    "min_tokens": ("min_new_tokens", _int), "min_new_tokens": ("min_new_tokens", _int),
    "temperature": ("temperature", _float), "top_p": ("top_p", _float),
    "top_k": ("top_k", _int), "min_p": ("min_p", _float), "seed": ("seed", _int),
    "repetition_penalty": ("repetition_penalty", _float),
    "presence_penalty": ("presence_penalty", _float),
    "frequency_penalty": ("frequency_penalty", _float),
    "n": ("n", _int), "best_of": ("best_of", _int),
    "stop": ("stop", _stop), "stop_token_ids": ("stop_token_ids", _int_list),
    "ignore_eos": ("ignore_eos", to_bool),
    "include_stop_str_in_output": ("include_stop_str_in_output", to_bool),
    "skip_special_tokens": ("skip_special_tokens", to_bool),
    "logprobs": ("logprobs", _int), "lora_name": ("lora_name", _str),
    "do_sample": ("do_sample", to_bool), "details": ("details", to_bool),
    "priority": ("priority", _int), "timeout": ("timeout", _float),
    "typical_p": ("typical_p", _float), "watermark": ("watermark", to_bool),
    "batch_size": ("batch_size", _int),
}
_SAMPLING_FIELDS = frozenset(Sampling.__dataclass_fields__)

# knob → (accepts, what it must be)
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_new_tokens": (lambda v: v >= 1, "at least 1"),
    "min_new_tokens": (lambda v: v >= 0, "non-negative"),
    "temperature": (lambda v: v >= 0, "non-negative"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: v >= -1, "-1 (disabled) or non-negative"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": (lambda v: v > 0, "positive"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "seed": (lambda v: 0 <= v <= INT64_MAX, f"in [0, {INT64_MAX}]"),
    "n": (lambda v: v >= 1, "at least 1"),
    "best_of": (lambda v: v >= 1, "at least 1"),
    "logprobs": (lambda v: v >= 0, "non-negative"),
    "stop_token_ids": (lambda v: all(i >= 0 for i in v), "non-negative token ids"),
    "timeout": (lambda v: 0 < v <= 65535, "in (0, 65535] seconds"),
    "typical_p": (lambda v: v == 1.0, "1.0 (typical sampling is not supported)"),
    "watermark": (lambda v: v is False, "false (watermarking is not supported)"),
}


@dataclass(frozen=True, slots=True)
class Knob:
    wire: str  # the name the client used, for messages
    value: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Knobs:
    """Everything the sampling knobs decide besides the text."""

    sampling: Sampling
    logprobs: int | None = None
    lora_name: str | None = None
    timeout_s: float | None = None
    details: bool = False


def read_knobs(params: Mapping[str, object], *, strict: bool) -> dict[str, Knob]:
    """Convert known parameters; unknown ones are an error when `strict`, else ignored."""
    knobs: dict[str, Knob] = {}
    for wire, raw in params.items():
        spec = KNOBS.get(wire)
        if spec is None:
            if strict:
                raise InvalidRequest(f"unknown sampling parameter '{wire}'", param=wire)
            continue
        knob, convert = spec
        knobs[knob] = Knob(wire, convert(wire, raw))
    return knobs


def to_knobs(knobs: Mapping[str, Knob], bounds: RequestBounds, default_max_tokens: int) -> Knobs:
    """Validate the knobs against their ranges and the server's bounds; build `Sampling`."""
    for name, knob in knobs.items():
        rule = _RULES.get(name)
        if rule is not None and not rule[0](knob.value):
            raise InvalidRequest(
                f"parameter '{knob.wire}' must be {rule[1]}, got {_show(knob.value)}",
                param=knob.wire,
            )
    values = {name: knob.value for name, knob in knobs.items() if name in _SAMPLING_FIELDS}
    sampling = replace(Sampling(max_new_tokens=default_max_tokens), **values)
    if "do_sample" in knobs and not knobs["do_sample"].value:
        sampling = replace(sampling, temperature=0.0)  # MindIE/TGI: do_sample=false is greedy
    _check_bounds(sampling, knobs, bounds)
    timeout = knobs.get("timeout")
    return Knobs(
        sampling=sampling,
        logprobs=_value(knobs, "logprobs"),
        lora_name=_value(knobs, "lora_name"),
        timeout_s=timeout.value if timeout else None,
        details=bool(_value(knobs, "details")),
    )


def _value(knobs: Mapping[str, Knob], name: str) -> Any:
    knob = knobs.get(name)
    return knob.value if knob is not None else None


def _wire(knobs: Mapping[str, Knob], name: str) -> str:
    knob = knobs.get(name)
    return knob.wire if knob is not None else name


def _check_bounds(sampling: Sampling, knobs: Mapping[str, Knob], bounds: RequestBounds) -> None:
    limits: list[tuple[str, int, int | None]] = [
        ("n", sampling.n, bounds.max_n),
        ("best_of", sampling.best_of or 0, bounds.max_best_of),
        ("max_new_tokens", sampling.max_new_tokens or 0, bounds.max_new_tokens),
        ("logprobs", _value(knobs, "logprobs") or 0, bounds.max_logprobs),
    ]
    for name, value, limit in limits:
        if limit is not None and value > limit:
            raise InvalidRequest(
                f"parameter '{_wire(knobs, name)}' must be at most {limit}, got {value}",
                param=_wire(knobs, name),
            )
    if sampling.best_of is not None and sampling.best_of < sampling.n:
        raise InvalidRequest("parameter 'best_of' must be at least 'n'", param="best_of")
    if sampling.max_new_tokens is not None and sampling.min_new_tokens > sampling.max_new_tokens:
        raise InvalidRequest(
            f"parameter '{_wire(knobs, 'min_new_tokens')}' must be at most "
            f"'{_wire(knobs, 'max_new_tokens')}'",
            param=_wire(knobs, "min_new_tokens"),
        )
    _check_stop(sampling.stop, bounds)


def _check_stop(stop: tuple[str, ...], bounds: RequestBounds) -> None:
    if len(stop) > bounds.max_stop_sequences:
        raise InvalidRequest(
            f"parameter 'stop' must have at most {bounds.max_stop_sequences} strings, "
            f"got {len(stop)}",
            param="stop",
        )
    for item in stop:
        if not item or len(item) > bounds.max_stop_length:
            raise InvalidRequest(
                f"each stop string must have 1 to {bounds.max_stop_length} characters",
                param="stop",
            )
