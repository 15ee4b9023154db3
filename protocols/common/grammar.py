"""TGI's `grammar` → `StructuredOutput`: read once, with the checks of TGI's router
(`router/src/validation.rs`), for TGI's `parameters.grammar` and for the same `{"type", "value"}`
forms TGI's clients send as an OpenAI `response_format`.

Forms: {"type": "json"|"json_object", "value": a schema or its JSON text}, {"type": "regex",
"value": a pattern}, {"type": "json_schema", "value": {"name"?, "schema"}}. A JSON schema must pass
draft 2020-12 meta-validation and have `properties` (vLLM itself would take one without); the
messages are the router's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jsonschema import Draft202012Validator, SchemaError

from server.core.errors import InvalidRequest
from server.core.json_limits import strict_loads
from server.core.types import StructuredOutput
from server.http import jsonio


def to_structured(grammar: Mapping[str, Any], *, field: str, param: str) -> StructuredOutput:
    """The structured output a grammar asks for; `InvalidRequest` naming `param` (the request
    field as the protocol reports it) otherwise. `field` is its name in the shape message."""
    kind, value = grammar.get("type"), grammar.get("value")
    if kind == "regex" and isinstance(value, str):
        return StructuredOutput(regex=value)
    if kind in ("json", "json_object") and "value" in grammar:
        return StructuredOutput(json_schema=_checked_schema(_json_value(value, param), param))
    if kind == "json_schema" and isinstance(value, dict) and "schema" in value:
        return StructuredOutput(json_schema=_checked_schema(value["schema"], param))
    raise InvalidRequest(
        f"`{field}` must be {{type: json|json_object|regex|json_schema, value: ...}} with a "
        "JSON schema or a regex",
        param=param,
    )


def _json_value(value: Any, param: str) -> Any:
    """A `json` grammar's value: an object, or a string that is re-parsed (TGI's router)."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            return strict_loads(value)
        except ValueError as exc:
            raise InvalidRequest(f"grammar is not valid: {exc}", param=param) from None
    raise InvalidRequest("grammar is not supported", param=param)


def _checked_schema(schema: Any, param: str) -> str:
    """Draft 2020-12 meta-validation, then `properties` required, as TGI's router does."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequest(f"grammar is not valid: {exc.message}", param=param) from None
    if not isinstance(schema, dict) or "properties" not in schema:
        raise InvalidRequest(
            "grammar is not valid: Grammar must have a 'properties' field", param=param
        )
    return jsonio.dumps(schema).decode()
