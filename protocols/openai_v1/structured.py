"""Structured-output asks of an OpenAI body → `StructuredOutput`: `response_format`
(json_object, json_schema, TGI's `{"type", "value"}` forms) and vLLM's `structured_outputs`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from protocols.common import grammar
from protocols.openai_v1 import schema
from server.core.errors import InvalidRequest, Unsupported
from server.core.types import StructuredOutput
from server.http import jsonio


def to_structured(body: schema.SamplingFields) -> StructuredOutput | None:
    """`response_format` (json_object, json_schema; TGI's `{"type", "value"}` forms, which its
    clients send to the same route) or vLLM's `structured_outputs`."""
    if body.structured_outputs:
        return vllm_structured(body.structured_outputs)
    fmt = body.response_format or {}
    kind = fmt.get("type", "text")
    if "value" in fmt:
        return grammar.to_structured(fmt, field="response_format", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema_ = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema_, dict):
            raise InvalidRequest(
                "response_format.json_schema.schema must be a JSON object.",
                param="response_format",
            )
        return StructuredOutput(json_schema=jsonio.dumps(schema_).decode())
    raise Unsupported(
        f"response_format type {str(kind)[:32]!r} is not supported by this server.",
        param="response_format",
    )


def vllm_structured(spec: Mapping[str, Any]) -> StructuredOutput:
    chosen = [k for k in ("json", "regex", "choice", "grammar", "json_object") if spec.get(k)]
    if len(chosen) != 1:
        raise InvalidRequest(
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object.",
            param="structured_outputs",
        )
    value = spec[chosen[0]]
    checks: dict[str, Callable[[Any], bool]] = {
        "json": lambda v: isinstance(v, dict | str),
        "regex": lambda v: isinstance(v, str),
        "grammar": lambda v: isinstance(v, str),
        "choice": lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v),
        "json_object": lambda v: v is True,
    }
    if not checks[chosen[0]](value):
        raise InvalidRequest(
            f"structured_outputs.{chosen[0]} has the wrong type.", param="structured_outputs"
        )
    if chosen[0] == "json":
        text = value if isinstance(value, str) else jsonio.dumps(value).decode()
        return StructuredOutput(json_schema=text)
    if chosen[0] == "choice":
        return StructuredOutput(choice=tuple(value))
    return StructuredOutput(
        regex=spec.get("regex"),
        grammar=spec.get("grammar"),
        json_object=bool(spec.get("json_object")),
    )
