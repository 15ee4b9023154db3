"""Bound a JSON schema so that every value it admits fits in a token budget.

Constrained decoding guarantees the *shape* of each token, not that the value ever ends: a model
can keep a string open until it runs out of tokens, and the truncated text is not JSON. Tool-call
arguments must be JSON that validates, so the engine tightens the schema first: every string,
array, integer and number the schema leaves unbounded gets a bound, the same for all of them,
chosen as generous as the budget allows. Any value of the bounded schema written without
whitespace takes at most `budget` bytes, hence at most `budget` tokens, and a value of the
bounded schema is a value of the original one.

Strings get a pattern without control characters, quotes or backslashes besides their length:
raw control characters are not valid JSON, and escapes would make a character cost six bytes.

References to the schema's own definitions (`{"$ref": "#/$defs/Name"}`, what pydantic writes for
a nested model, and a lone `allOf: [{"$ref": ...}]`) are replaced by the definition first, so
such schemas are bounded too; a recursive or outside reference cannot be.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

JsonSchema = dict[str, Any]

# Generous first: (characters per string, items per array, digits of an integer part); the
# first level that fits is used.
LEVELS: tuple[tuple[int, int, int], ...] = (
    (1024, 16, 9), (512, 16, 9), (256, 8, 9), (128, 8, 6), (64, 4, 6), (32, 4, 4), (16, 2, 4),
    (8, 2, 3), (4, 1, 2), (1, 1, 1),
)
FRACTION_DIGITS = 6  # what the grammar compiler allows after the point of a bounded number
BYTES_PER_CHAR = 4  # UTF-8
_UNBOUNDED_KEYS = frozenset({"$ref", "allOf", "not", "if", "patternProperties", "dependencies"})


class Unbounded(Exception):
    """The schema has a part this module cannot bound."""


def fit_schema(schema: JsonSchema, budget: int) -> tuple[JsonSchema, bool]:
    """The most generous bounded copy of `schema` whose values fit in `budget` bytes, and
    whether it fits. When even the tightest level does not fit, or the schema cannot be bounded,
    the tightest copy (or the schema itself) comes back with False."""
    tightest: JsonSchema = schema
    try:
        inlined = inline_definitions(schema) if DEFINITIONS & schema.keys() else schema
    except Unbounded:
        return schema, False
    for optional in (True, False):  # at last, objects keep only their required properties
        for level in LEVELS:
            try:
                bounded = _bound(inlined, Level(*level, optional))
            except Unbounded:
                return schema, False
            tightest = bounded
            if worst_size(bounded) <= budget:
                return bounded, True
    return tightest, False


DEFINITIONS = frozenset({"$defs", "definitions"})
MAX_INLINED = 4096  # subschemas an inlined copy may have (references can multiply them)
# where a keyword holds subschemas: one, a list of them, or a name → subschema mapping
_ONE = frozenset({"items", "additionalProperties", "not", "if", "then", "else", "contains"})
_LIST = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_MAP = frozenset({"properties", "patternProperties"})


def inline_definitions(schema: JsonSchema) -> JsonSchema:
    """`schema` without its definitions: every `#/$defs/<name>` (or `#/definitions/<name>`)
    reference replaced by that definition, beside the reference's other keywords, and a lone
    `allOf` merged into its schema. Raises Unbounded for a reference elsewhere, to a missing
    or recursive definition, or a copy past MAX_INLINED subschemas."""
    defs: dict[str, Any] = {}
    for key in DEFINITIONS:
        found = schema.get(key, {})
        if not isinstance(found, dict):
            raise Unbounded(f"`{key}` is not an object")
        defs.update({f"#/{key}/{name}": value for name, value in found.items()})
    root = {key: value for key, value in schema.items() if key not in DEFINITIONS}
    inlined = _Inliner(defs).schema(root, frozenset())
    assert isinstance(inlined, dict)  # as `root` is
    return inlined


class _Inliner:
    def __init__(self, defs: dict[str, Any]) -> None:
        self._defs = defs
        self._left = MAX_INLINED

    def schema(self, node: object, seen: frozenset[str]) -> Any:
        if not isinstance(node, dict):
            return node  # true / false
        self._left -= 1
        if self._left < 0:
            raise Unbounded("too many subschemas once references are inlined")
        ref = node.get("$ref")
        if ref is not None:
            target = self._defs.get(ref) if isinstance(ref, str) else None
            if not isinstance(target, dict) or ref in seen:
                raise Unbounded(f"the reference {ref!r}")
            return self.schema(_merged(target, node, "$ref"), seen | {ref})
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) == 1 and isinstance(all_of[0], dict):
            return self.schema(_merged(all_of[0], node, "allOf"), seen)
        return {key: self._keyword(key, value, seen) for key, value in node.items()}

    def _keyword(self, key: str, value: object, seen: frozenset[str]) -> Any:
        if key in _ONE:
            return self.schema(value, seen)
        if key in _LIST and isinstance(value, list):
            return [self.schema(item, seen) for item in value]
        if key in _MAP and isinstance(value, dict):
            return {name: self.schema(item, seen) for name, item in value.items()}
        return value  # data (enum, const, default, ...) or an annotation


ANNOTATIONS = frozenset({"title", "description", "default", "examples", "deprecated"})


def _merged(target: JsonSchema, node: JsonSchema, by: str) -> JsonSchema:
    """`target` with `node`'s other keywords beside it. Both must hold: a keyword both give
    differently (other than an annotation) would need them combined, which is not done here."""
    rest = {key: value for key, value in node.items() if key != by}
    for key, value in rest.items():
        if key in target and target[key] != value and key not in ANNOTATIONS:
            raise Unbounded(f"`{key}` beside {by}")
    return {**target, **rest}


def worst_size(schema: JsonSchema) -> int:
    """The most bytes a value of a bounded schema takes, written without whitespace."""
    if "const" in schema:
        return _dumped_size(schema["const"])
    if "enum" in schema:
        return max((_dumped_size(value) for value in schema["enum"]), default=0)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return max((worst_size(branch) for branch in schema[key]), default=0)
    kinds = _types(schema)
    if not kinds:
        raise Unbounded("a schema without a type")
    return max(_worst_of_type(kind, schema) for kind in kinds)


def _worst_of_type(kind: str, schema: JsonSchema) -> int:
    if kind == "string":
        return 2 + BYTES_PER_CHAR * _pattern_length(schema["pattern"])
    if kind in ("integer", "number"):
        digits = max(len(str(int(schema["minimum"]))), len(str(int(schema["maximum"]))))
        return digits if kind == "integer" else digits + 1 + FRACTION_DIGITS
    if kind == "boolean":
        return 5
    if kind == "null":
        return 4
    if kind == "array":
        items = [*schema.get("prefixItems", []), schema["items"]]
        each = max(worst_size(item) for item in items)
        return 2 + int(schema["maxItems"]) * (each + 1)
    if kind == "object":
        properties = schema.get("properties", {})
        fields = sum(_dumped_size(key) + 2 + worst_size(value) for key, value in properties.items())
        return 2 + fields
    raise Unbounded(f"type {kind!r}")


class Level(NamedTuple):
    chars: int  # per string
    items: int  # per array
    digits: int  # of an integer part
    optional: bool  # objects keep their optional properties


def _bound(schema: JsonSchema, level: Level) -> JsonSchema:
    if not isinstance(schema, dict) or _UNBOUNDED_KEYS & schema.keys():
        raise Unbounded("a keyword that cannot be bounded")
    out = dict(schema)
    if "const" in out or "enum" in out:
        return out
    for key in ("anyOf", "oneOf"):
        if key in out:
            inherited = {"type": out["type"]} if "type" in out else {}
            out[key] = [_bound({**inherited, **branch}, level) for branch in out[key]]
            return out
    kinds = _types(out)
    if not kinds:
        raise Unbounded("a schema without a type")
    for kind in kinds:
        _bound_type(kind, out, level)
    return out


def _bound_type(kind: str, out: JsonSchema, level: Level) -> None:
    if kind == "string":
        _bound_string(out, level.chars)
    elif kind in ("integer", "number"):
        _bound_number(out, 10**level.digits - 1)
    elif kind == "array":
        _bound_array(out, level)
    elif kind == "object":
        _bound_object(out, level)
    elif kind not in ("boolean", "null"):
        raise Unbounded(f"type {kind!r}")


def _bound_string(out: JsonSchema, chars: int) -> None:
    if "pattern" in out or "format" in out:
        raise Unbounded("a string pattern or format")
    length = min(int(out.pop("maxLength", chars)), chars)
    least = int(out.pop("minLength", 0))
    length = max(length, least)
    # the pattern carries the length (grammar compilers apply one or the other, not both)
    out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{least},{length}}}$'


def _bound_number(out: JsonSchema, limit: int) -> None:
    low = out.get("minimum", out.get("exclusiveMinimum"))
    high = out.get("maximum", out.get("exclusiveMaximum"))
    if low is None:
        low = min(0, high if high is not None else 0) - limit
    if high is None:
        high = max(0, low) + limit
    out.setdefault("minimum", low)
    out.setdefault("maximum", high)


def _bound_array(out: JsonSchema, level: Level) -> None:
    if "items" not in out or out["items"] is True:
        raise Unbounded("an array without an item schema")
    items = level.items
    out["items"] = _bound(out["items"], level)
    if "prefixItems" in out:
        out["prefixItems"] = [_bound(item, level) for item in out["prefixItems"]]
    most = min(int(out.get("maxItems", items)), items)
    out["maxItems"] = max(most, int(out.get("minItems", 0)))


def _bound_object(out: JsonSchema, level: Level) -> None:
    extra = out.get("additionalProperties", True)
    if extra not in (True, False):
        raise Unbounded("an object with typed additional properties")
    properties = out.get("properties", {})
    required = set(out.get("required", ()))
    out["properties"] = {
        key: _bound(value, level)
        for key, value in properties.items()
        if level.optional or key in required
    }
    out["additionalProperties"] = False


def _pattern_length(pattern: str) -> int:
    """The upper bound of a pattern written by `_bound_string`."""
    return int(pattern.rsplit(",", 1)[1].split("}", 1)[0])


def _types(schema: JsonSchema) -> list[str]:
    kind = schema.get("type")
    if kind is None:
        return []
    return [kind] if isinstance(kind, str) else [str(k) for k in kind]


def _dumped_size(value: object) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
