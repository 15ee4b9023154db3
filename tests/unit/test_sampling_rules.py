"""The sampling rules protocols share (server/core/sampling.py): model defaults for omitted
fields, and vLLM's StructuredOutputsParams shape read into a StructuredOutput."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from server.core.errors import InvalidRequest, Unsupported
from server.core.sampling import omitted_fields, vllm_structured, with_model_defaults
from server.core.types import Sampling, SamplingDefaults, StructuredOutput

DEFAULTS = SamplingDefaults(
    temperature=0.7, top_p=0.9, top_k=40, min_p=0.1, repetition_penalty=1.05,
    presence_penalty=0.5, frequency_penalty=0.2, max_new_tokens=64,
)
EVERYTHING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
              "presence_penalty", "frequency_penalty", "max_new_tokens")


def test_omitted_fields_take_the_model_default() -> None:
    sampling = with_model_defaults(Sampling(max_new_tokens=16), DEFAULTS, EVERYTHING)
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (
        0.7, 0.9, 40, 0.1
    )
    assert (sampling.repetition_penalty, sampling.presence_penalty,
            sampling.frequency_penalty) == (1.05, 0.5, 0.2)
    assert sampling.max_new_tokens is None  # the engine applies the model's limit in the room


def test_fields_not_named_keep_the_protocol_value() -> None:
    given = Sampling(temperature=0.3, max_new_tokens=16)
    sampling = with_model_defaults(given, DEFAULTS, ["top_k"])
    assert (sampling.temperature, sampling.top_k, sampling.max_new_tokens) == (0.3, 40, 16)


def test_a_model_without_a_default_leaves_the_protocol_value() -> None:
    given = Sampling(temperature=1.0, max_new_tokens=30)
    assert with_model_defaults(given, SamplingDefaults(top_p=0.8), EVERYTHING) == Sampling(
        temperature=1.0, top_p=0.8, max_new_tokens=30
    )


def test_greedy_keeps_its_warpers_but_takes_penalties_and_the_limit() -> None:
    greedy = Sampling(temperature=0.0, max_new_tokens=20)
    sampling = with_model_defaults(greedy, DEFAULTS, EVERYTHING, greedy=True)
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (
        0.0, 1.0, 0, 0.0
    )
    assert sampling.repetition_penalty == 1.05 and sampling.max_new_tokens is None


def test_omitted_fields_are_the_none_attributes() -> None:
    source = SimpleNamespace(temperature=None, top_p=0.5, top_k=None)
    assert omitted_fields(source, ["temperature", "top_p", "top_k"]) == ["temperature", "top_k"]


# ---- vLLM's StructuredOutputsParams --------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"json": {"type": "object"}}, StructuredOutput(json_schema='{"type":"object"}')),
        ({"json": '{"enum": ["é"]}'}, StructuredOutput(json_schema='{"enum":["é"]}')),
        ({"regex": "[ab]+"}, StructuredOutput(regex="[ab]+")),
        ({"choice": ["yes", "no"]}, StructuredOutput(choice=("yes", "no"))),
        ({"grammar": 'root ::= "a"'}, StructuredOutput(grammar='root ::= "a"')),
        ({"json_object": True}, StructuredOutput(json_object=True)),
        ({"regex": "a", "json": None, "disable_any_whitespace": False},
         StructuredOutput(regex="a")),
    ],
)
def test_each_constraint_becomes_a_structured_output(
    spec: dict[str, Any], expected: StructuredOutput
) -> None:
    assert vllm_structured(spec, param="so") == expected


def test_several_constraints_are_refused_with_vllms_message() -> None:
    with pytest.raises(InvalidRequest) as caught:
        vllm_structured({"regex": "a", "choice": ["b"]}, param="so")
    assert caught.value.message == (
        "You can only use one kind of structured outputs constraint but multiple are "
        "specified: {'regex': 'a', 'choice': ['b']}"
    )
    assert caught.value.param == "so"


def test_no_constraint_is_refused_with_vllms_message() -> None:
    with pytest.raises(InvalidRequest) as caught:
        vllm_structured({"json": None}, param="so")
    assert caught.value.message == (
        "You must use one kind of structured outputs constraint but none are specified: "
        "{'json': None}"
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": 3}, "so.json must be a JSON schema (an object, or a string holding one)"),
        ({"json": "{nope"}, "so.json is not valid JSON: Expecting property name"),
        ({"json_object": False}, "so.json_object must be true, got False"),
        ({"choice": []}, "so.choice must be a non-empty list of strings"),
        ({"choice": ["a", 1]}, "so.choice must be a non-empty list of strings"),
        ({"regex": ""}, "so.regex must be a non-empty string"),
        ({"grammar": ["x"]}, "so.grammar must be a non-empty string"),
        ({"regex": "a", "guided_json": {}},
         "so has unknown keys ['guided_json']; it takes one of json, regex, choice, grammar, "
         "json_object"),
    ],
)
def test_wrong_values_are_invalid(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        vllm_structured(spec, param="so")
    assert caught.value.message.startswith(message)


@pytest.mark.parametrize(
    "spec",
    [
        {"structural_tag": "{}"},
        {"regex": "a", "disable_any_whitespace": True},
        {"regex": "a", "whitespace_pattern": " "},
        {"json": {}, "disable_additional_properties": True},
    ],
)
def test_what_the_engine_port_cannot_carry_is_refused(spec: dict[str, Any]) -> None:
    with pytest.raises(Unsupported, match="is not supported by this server"):
        vllm_structured(spec, param="so")
