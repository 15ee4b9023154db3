"""Sampling rules every protocol applies the same way: the model's defaults for the fields a
request leaves out, and vLLM's `StructuredOutputsParams` shape (Triton's `sampling_parameters`,
DJL's `parameters.structured_outputs`) read into a `StructuredOutput`.

Standard library only, like the rest of the core.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from server.core.errors import InvalidRequest, Unsupported
from server.core.frozen import replaced
from server.core.json_limits import strict_loads
from server.core.types import Sampling, SamplingDefaults, StructuredOutput

# What decides how a token is drawn; a greedy request keeps them neutral whatever the model says.
WARPERS = frozenset({"temperature", "top_p", "top_k", "min_p"})
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# StructuredOutputsParams options the engine port cannot carry, with the value that is a no-op.
_NEUTRAL_OPTIONS: dict[str, object] = {
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
}


def with_model_defaults(
    sampling: Sampling,
    defaults: SamplingDefaults,
    omitted: Iterable[str],
    *,
    greedy: bool = False,
) -> Sampling:
    """`sampling` where each field named in `omitted` takes the model's default, when the model
    has one (the others keep the protocol's own default). A greedy request keeps its warpers.

    An omitted `max_new_tokens` becomes None: the engine then applies the model's limit itself,
    within the room the prompt leaves (a default never makes a request too long)."""
    values: dict[str, Any] = {}
    for name in omitted:
        value = getattr(defaults, name)
        if value is None or (greedy and name in WARPERS):
            continue
        values[name] = None if name == "max_new_tokens" else value
    return replaced(sampling, **values) if values else sampling


def omitted_fields(source: object, names: Iterable[str]) -> list[str]:
    """The names among `names` whose attribute on `source` is None (left out by the client)."""
    return [name for name in names if getattr(source, name) is None]


# ---- vLLM's StructuredOutputsParams ----------------------------------------------------------


def _show(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def vllm_structured(spec: Mapping[str, Any], *, param: str) -> StructuredOutput:
    """vLLM's `StructuredOutputsParams` (a mapping) → `StructuredOutput`.

    Exactly one of json, regex, choice, grammar, json_object, with vLLM's messages for none or
    several. Keys vLLM would ignore and options this server cannot apply are refused, so a
    request never runs unconstrained while the client believes otherwise."""
    unknown = sorted(set(spec) - set(CONSTRAINTS) - set(_NEUTRAL_OPTIONS))
    if unknown:
        raise InvalidRequest(
            f"{param} has unknown keys {unknown}; it takes one of "
            "json, regex, choice, grammar, json_object",
            param=param,
        )
    given = {k: spec[k] for k in CONSTRAINTS if spec.get(k) is not None}
    if len(given) > 1:
        raise InvalidRequest(
            "You can only use one kind of structured outputs constraint but multiple are "
            f"specified: {_show(given)}",
            param=param,
        )
    if not given:
        raise InvalidRequest(
            "You must use one kind of structured outputs constraint but none are specified: "
            f"{_show(dict(spec))}",
            param=param,
        )
    _check_options(spec, param)
    kind, value = next(iter(given.items()))
    return _constraint(kind, value, param)


def _check_options(spec: Mapping[str, Any], param: str) -> None:
    for name, neutral in _NEUTRAL_OPTIONS.items():
        if spec.get(name, neutral) != neutral:
            raise Unsupported(
                f"{param}.{name} is not supported by this server", param=f"{param}.{name}"
            )


def _constraint(kind: str, value: Any, param: str) -> StructuredOutput:
    where = f"{param}.{kind}"
    if kind == "json":
        return StructuredOutput(json_schema=json_schema_text(value, where))
    if kind == "json_object":
        if value is not True:
            raise InvalidRequest(f"{where} must be true, got {_show(value)}", param=where)
        return StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(f"{where} must be a non-empty list of strings", param=where)
        return StructuredOutput(choice=tuple(value))
    if kind == "structural_tag":
        raise Unsupported(f"{where} is not supported by this server", param=where)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{where} must be a non-empty string", param=where)
    return StructuredOutput(regex=value) if kind == "regex" else StructuredOutput(grammar=value)


def json_schema_text(value: object, where: str) -> str:
    """A JSON schema given as an object or as a string holding one → compact JSON text."""
    schema = value
    if isinstance(value, str):
        try:
            schema = strict_loads(value)
        except ValueError as exc:
            raise InvalidRequest(f"{where} is not valid JSON: {exc}", param=where) from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequest(
            f"{where} must be a JSON schema (an object, or a string holding one)", param=where
        )
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
