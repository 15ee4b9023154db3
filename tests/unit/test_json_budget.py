"""`fit_schema`: bounded copies of a schema whose every value fits the token budget."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.core.json_budget import LEVELS, fit_schema, worst_size

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "lat": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "exact": {"type": "boolean"},
        "note": {"type": ["string", "null"]},
    },
    "required": ["city"],
}


def _largest(schema: dict[str, Any]) -> Any:  # noqa: PLR0911 - one value per kind
    """The value of a bounded schema that takes the most bytes."""
    if "enum" in schema:
        return max(schema["enum"], key=lambda v: len(json.dumps(v, separators=(",", ":"))))
    if "anyOf" in schema:  # the test schemas put the largest branch first
        return _largest(schema["anyOf"][0])
    kind = schema["type"]
    kind = kind[0] if isinstance(kind, list) else kind
    if kind == "string":
        most = int(re.search(r",(\d+)\}\$$", schema["pattern"]).group(1))  # type: ignore[union-attr]
        return "\u4e2d" * most  # three bytes each in UTF-8
    if kind == "integer":
        return schema["minimum"]
    if kind == "number":
        return schema["minimum"] - 0.123456
    if kind == "boolean":
        return False
    if kind == "array":
        return [_largest(schema["items"])] * schema["maxItems"]
    return {key: _largest(value) for key, value in schema["properties"].items()}


@pytest.mark.parametrize("budget", [30, 64, 100, 200, 500, 4000])
def test_the_largest_value_fits_the_budget(budget: int) -> None:
    bounded, fits = fit_schema(WEATHER, budget)
    assert fits
    value = _largest(bounded)
    assert len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()) <= budget
    assert worst_size(bounded) <= budget


def test_bounds_are_as_generous_as_the_budget_allows() -> None:
    small, _ = fit_schema(WEATHER, 300)
    large, _ = fit_schema(WEATHER, 100_000)
    assert small["properties"]["city"]["pattern"].endswith(",8}$")
    assert large["properties"]["city"]["pattern"].endswith(f",{LEVELS[0][0]}}}$")
    assert large["properties"]["tags"]["maxItems"] == LEVELS[0][1]


def test_the_schema_own_bounds_are_kept_and_values_stay_valid() -> None:
    schema = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 2, "maxLength": 3},
            "n": {"type": "integer", "minimum": -5},
            "xs": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
        },
    }
    bounded, fits = fit_schema(schema, 10_000)
    assert fits
    assert bounded["properties"]["code"]["pattern"].endswith("{2,3}$")
    assert bounded["properties"]["n"]["minimum"] == -5
    assert bounded["properties"]["xs"]["maxItems"] == 3
    assert bounded["additionalProperties"] is False
    assert schema["properties"]["code"] == {"type": "string", "minLength": 2, "maxLength": 3}


def test_strings_leave_out_control_characters_quotes_and_backslashes() -> None:
    bounded, _ = fit_schema({"type": "string"}, 100)
    pattern = re.compile(bounded["pattern"])
    assert pattern.fullmatch("plain text")
    for bad in ("a\x07", 'say "hi"', "back\\slash", "line\nbreak"):
        assert not pattern.fullmatch(bad)


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#/$defs/x"},
        {"type": "string", "pattern": "^a+$"},
        {"type": "object", "additionalProperties": {"type": "string"}},
        {"type": "array"},
        {"properties": {"a": {"type": "string"}}},
    ],
)
def test_what_cannot_be_bounded_comes_back_as_it_was(schema: dict[str, Any]) -> None:
    assert fit_schema(schema, 1000) == (schema, False)


def test_tight_budgets_keep_only_required_properties() -> None:
    bounded, fits = fit_schema(WEATHER, 40)
    assert fits
    assert list(bounded["properties"]) == ["city"]


def test_a_budget_too_small_for_anything_returns_the_tightest_copy() -> None:
    bounded, fits = fit_schema(WEATHER, 5)
    assert not fits
    assert bounded["properties"]["city"]["pattern"].endswith(",1}$")


def test_the_required_tool_call_shape_is_bounded() -> None:
    schema = {
        "type": "array", "minItems": 1, "maxItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": WEATHER}, "required": ["name", "parameters"]},
        ]},
    }
    bounded, fits = fit_schema(schema, 300)
    assert fits
    assert worst_size(bounded) <= 300


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(min_value=60, max_value=5000), strings=st.integers(0, 6))
def test_any_budget_holds(budget: int, strings: int) -> None:
    schema = {
        "type": "object",
        "properties": {f"s{i}": {"type": "string"} for i in range(strings)},
    }
    bounded, fits = fit_schema(schema, budget)
    assert fits
    largest = json.dumps(_largest(bounded), ensure_ascii=False, separators=(",", ":"))
    assert len(largest.encode()) <= budget


NESTED = {  # what pydantic writes for a model with a nested model and an optional one
    "type": "object",
    "$defs": {
        "Place": {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"]},
    },
    "properties": {
        "home": {"$ref": "#/$defs/Place", "description": "where"},
        "work": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]},
        "old": {"allOf": [{"$ref": "#/$defs/Place"}], "default": None},
    },
    "required": ["home"],
}


def test_references_to_the_schemas_own_definitions_are_inlined_and_bounded() -> None:
    bounded, fits = fit_schema(NESTED, 400)
    assert fits and "$defs" not in bounded
    text = json.dumps(bounded)
    assert "$ref" not in text and "allOf" not in text
    home = bounded["properties"]["home"]
    assert home["description"] == "where" and home["additionalProperties"] is False
    assert re.compile(home["properties"]["city"]["pattern"]).fullmatch("Paris")
    assert not re.compile(home["properties"]["city"]["pattern"]).fullmatch("Par\x16is")
    assert bounded["properties"]["work"]["anyOf"][0]["properties"]["city"]["pattern"]


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}}},
         "$ref": "#/$defs/N"},  # recursive
        {"$defs": {"A": {"type": "string"}}, "$ref": "other.json#/A"},  # elsewhere
        {"$defs": [], "type": "string"},
    ],
)
def test_references_that_cannot_be_inlined_leave_the_schema_as_it_was(
    schema: dict[str, Any],
) -> None:
    assert fit_schema(schema, 1000) == (schema, False)


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"A": {"type": "integer", "maximum": 5}},
         "type": "object", "properties": {"a": {"allOf": [{"$ref": "#/$defs/A"}],
                                                 "maximum": 100}}, "required": ["a"]},
        {"$defs": {"A": {"type": "object", "properties": {"x": {"type": "string"}},
                         "required": ["x"]}},
         "$ref": "#/$defs/A", "required": []},
    ],
)
def test_a_keyword_beside_a_reference_that_differs_from_its_definition_is_not_merged(
    schema: dict[str, Any],
) -> None:
    """Both must hold: taking one of the two would admit values the schema refuses."""
    assert fit_schema(schema, 1000) == (schema, False)
