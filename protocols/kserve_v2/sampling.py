"""Sampling knobs of the Triton routes → `Sampling`, under both names clients use.

Triton's vLLM backend reads vLLM `SamplingParams` field names (`max_tokens`, `temperature`,
`top_p`, `top_k`, `ignore_eos`, `stop`, `structured_outputs`, `lora_name`, …) from the
`sampling_parameters` JSON tensor or from the request parameters; MindIE's Triton routes use
TGI-style names (`max_new_tokens`, `do_sample`, `repetition_penalty`, `seed`, `details`, …). Both
spellings are accepted everywhere.

Every `SamplingParams` field of vLLM 0.32 is a known key: the ones the engine port carries are
applied; the others (`prompt_logprobs`, `detokenize`, `extra_args`, …) are accepted only at their
default and refused otherwise, never silently dropped. An unknown key is an error in both places,
as `SamplingParams(**params)` is in the backend, with the backend's "Error generating stream: "
prefix and the real cause (the backend itself reports a useless `'NoneType' object has no
attribute 'lora_name'`), status 400 rather than the backend's 500. Request parameters may also
carry Triton's own keys (`binary_data_output`, `sequence_id`, `triton_*`, …) and the generate
extension's input flags (`stream`, `exclude_input_in_output`, `return_*`): those are not knobs.

`structured_outputs` is vLLM's `StructuredOutputsParams` as a JSON string (an object is taken
too): exactly one of json, regex, choice, grammar, json_object. `guided_decoding`, its older
name, is read the same way (a `backend` of xgrammar or auto is dropped, as the backend does).

`priority` and `batch_size` are accepted and not applied (vLLM's priority scheduling is off).
Like the vLLM backend, numbers may arrive as strings (`"max_tokens": "32"`): Triton request
parameters are often strings. Omitted fields take the model's defaults (its
`generation_config.json`), else the route's own; `do_sample: false` stays greedy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from protocols.common.budget import VLLM_REFUSES
from protocols.kserve_v2.models import INPUT_SPECS
from server.core.errors import InvalidRequest, Unsupported
from server.core.frozen import quick_init, replaced
from server.core.sampling import vllm_structured, with_model_defaults
from server.core.types import Sampling, SamplingDefaults, StructuredOutput
from server.http import jsonio
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


def _str_list(name: str, raw: object) -> tuple[str, ...]:
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return tuple(raw)
    raise InvalidRequest(f"parameter '{name}' must be a list of strings", param=name)


def _logit_bias(name: str, raw: object) -> tuple[tuple[int, float], ...]:
    """{token id: bias}; ids are JSON object keys, so strings of digits."""
    if not isinstance(raw, dict):
        raise InvalidRequest(
            f"parameter '{name}' must be an object of token id to bias", param=name
        )
    return tuple((_int(name, key), _float(name, value)) for key, value in raw.items())


def _json_object(raw: object) -> object:
    """A JSON object given as a string (the backend's form) or as an object; else as given."""
    if not isinstance(raw, str):
        return raw
    try:
        return jsonio.loads(raw)
    except jsonio.JSONDecodeError:
        return None


def _structured(name: str, raw: object) -> StructuredOutput:
    """vLLM's StructuredOutputsParams, as the JSON string the backend expects (or an object)."""
    spec = _json_object(raw)
    if not isinstance(spec, dict):
        raise InvalidRequest(
            f"parameter '{name}' must be a JSON object (as a string) with one of json, regex, "
            "choice, grammar, json_object",
            param=name,
        )
    return vllm_structured(spec, param=name)


# The request-level backends the vLLM backend still accepts in `guided_decoding` (and drops).
GUIDED_BACKENDS = frozenset({"xgrammar", "xgrammar:no-fallback", "auto", "xgrammar:_auto"})


def _guided(name: str, raw: object) -> StructuredOutput:
    """The backend's older name for `structured_outputs`, as an object or a JSON string; a
    `backend` key is dropped if it names xgrammar or auto, else refused (as the backend)."""
    spec = _json_object(raw)
    if isinstance(spec, dict) and "backend" in spec:
        backend = spec["backend"]
        if backend not in GUIDED_BACKENDS:
            raise InvalidRequest(
                "guided_decoding.backend is no longer supported request-level. Provided: "
                f"{_show(backend)}",
                param=name,
            )
        spec = {key: value for key, value in spec.items() if key != "backend"}
    return _structured(name, spec)


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
    "logit_bias": ("logit_bias", _logit_bias),
    "allowed_token_ids": ("allowed_token_ids", _int_list),
    "bad_words": ("bad_words", _str_list),
    "structured_outputs": ("structured", _structured),
    "guided_decoding": ("guided", _guided),
}
_SAMPLING_FIELDS = frozenset(Sampling.__dataclass_fields__)

# The other SamplingParams fields of vLLM 0.32, with their default: accepted only at it, since
# the engine port does not carry them.
AT_DEFAULT_ONLY: dict[str, bool | int | None] = {
    "watermarking": False, "prompt_logprobs": None, "prompt_logprob_token_ids": None,
    "prompt_logprob_start": None, "logprob_token_ids": None, "flat_logprobs": False,
    "detokenize": True, "spaces_between_special_tokens": True, "output_kind": None,
    "stream_interval": None, "skip_clone": False, "output_text_buffer_length": 0,
    "extra_args": None, "skip_reading_prefix_cache": False, "thinking_token_budget": None,
    "repetition_detection": None, "routed_experts_prompt_start": 0,
    "trace_decode_token_ids": None,
}
KNOWN = frozenset(KNOBS) | frozenset(AT_DEFAULT_ONLY)
# Request parameters Triton reads itself (tritonclient's reserved names and prefix) and the
# generate extension's inputs given as parameters: present, but not sampling knobs.
TRITON_REQUEST_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "headers", "binary_data_output"}
)
TRITON_PREFIX = "triton_"
# The model's defaults, under the knob names; `do_sample: false` keeps the neutral warpers.
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "max_new_tokens")
NO_DEFAULTS = SamplingDefaults()

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
    "allowed_token_ids": (lambda v: v and all(i >= 0 for i in v), "non-empty, token ids"),
    "logit_bias": (lambda v: all(i >= 0 for i, _ in v), "keyed by non-negative token ids"),
    "timeout": (lambda v: 0 < v <= 65535, "in (0, 65535] seconds"),
    "typical_p": (lambda v: v == 1.0, "1.0 (typical sampling is not supported)"),
    "watermark": (lambda v: v is False, "false (watermarking is not supported)"),
}


@quick_init
@dataclass(frozen=True, slots=True)
class Knob:
    wire: str  # the name the client used, for messages
    value: Any


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Knobs:
    """Everything the sampling knobs decide besides the text."""

    sampling: Sampling
    logprobs: int | None = None
    lora_name: str | None = None
    timeout_s: float | None = None
    details: bool = False


def read_knobs(params: Mapping[str, object], *, from_request: bool) -> dict[str, Knob]:
    """Convert known parameters; anything else is an error, except in request parameters
    (`from_request`), where Triton's own keys and the input flags are skipped."""
    knobs: dict[str, Knob] = {}
    for wire, raw in params.items():
        spec = KNOBS.get(wire)
        if spec is not None:
            knob, convert = spec
            knobs[knob] = Knob(wire, convert(wire, raw))
        elif wire in AT_DEFAULT_ONLY:
            _check_at_default(wire, raw)
        elif not (from_request and _triton_owned(wire)):
            raise InvalidRequest(
                f"Error generating stream: Unexpected keyword argument '{wire}' (sampling "
                "parameters are vLLM SamplingParams fields and lora_name)",
                param=wire,
            )
    guided = knobs.pop("guided", None)
    if guided is not None:  # structured_outputs wins when both are given, as in the backend
        knobs.setdefault("structured", guided)
    return knobs


def _triton_owned(name: str) -> bool:
    """Keys request parameters may carry besides sampling knobs: Triton's own and the input
    flags. Not `sampling_parameters`: its knobs would go unread (vllm_backend refuses it)."""
    return (
        name in TRITON_REQUEST_PARAMETERS
        or (name in INPUT_SPECS and name != "sampling_parameters")
        or name.startswith(TRITON_PREFIX)
    )


def _check_at_default(name: str, raw: object) -> None:
    if not _at_default(name, raw):
        shown = jsonio.dumps(AT_DEFAULT_ONLY[name]).decode()
        raise Unsupported(
            f"sampling parameter '{name}' is not supported by this server (only its default, "
            f"{shown}, is accepted)",
            param=name,
        )


def _at_default(name: str, raw: object) -> bool:
    default = AT_DEFAULT_ONLY[name]
    if raw is None:
        return True
    if isinstance(default, bool):
        return to_bool(name, raw) == default
    if isinstance(default, int):
        return not isinstance(raw, bool | list | dict) and _int(name, raw) == default
    return False


def to_knobs(
    knobs: Mapping[str, Knob],
    bounds: RequestBounds,
    default_max_tokens: int,
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> Knobs:
    """Validate the knobs against their ranges and the server's bounds; build `Sampling`, where
    what the request leaves out takes the model's `defaults`, else the route's own."""
    for name, knob in knobs.items():
        rule = _RULES.get(name)
        if rule is not None and not rule[0](knob.value):
            raise InvalidRequest(
                f"parameter '{knob.wire}' must be {rule[1]}, got {_show(knob.value)}",
                param=knob.wire,
            )
    values = {name: knob.value for name, knob in knobs.items() if name in _SAMPLING_FIELDS}
    sampling = Sampling(**{"max_new_tokens": default_max_tokens, "budget": VLLM_REFUSES, **values})
    greedy = "do_sample" in knobs and not knobs["do_sample"].value
    if greedy:
        sampling = replaced(sampling, temperature=0.0)  # MindIE/TGI: do_sample=false is greedy
    omitted = [name for name in DEFAULTED if name not in knobs]
    sampling = with_model_defaults(sampling, defaults, omitted, greedy=greedy)
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
