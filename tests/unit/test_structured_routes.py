"""Structured output on TGI, Triton and DJL routes through the in-process gateway (fake engine):
what reaches the engine, and every bad input in the protocol's own error shape, never a 500.
Real-engine proofs with the official clients: tests/conformance/test_structured_outputs.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from server.core.types import StructuredOutput
from server.engines.fake import FakeEngine
from tests.unit.gateway_kit import client, make_gateway

pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["good", "bad"]}},
          "required": ["mood"]}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))


class Gw:
    def __init__(self, http: httpx.AsyncClient, engine: FakeEngine) -> None:
        self.http = http
        self.engine = engine

    def structured(self) -> StructuredOutput | None:
        return self.engine.requests[-1].sampling.structured


@pytest.fixture
async def gw() -> AsyncIterator[Gw]:
    gateway = make_gateway()
    assert isinstance(gateway.engine, FakeEngine)
    async with client(gateway, "data") as http:
        yield Gw(http, gateway.engine)


# ---- TGI -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
async def test_tgi_grammar_reaches_the_engine(gw: Gw, path: str) -> None:
    grammar = {"type": "json", "value": SCHEMA}
    response = await gw.http.post(path, json={"inputs": "a", "parameters": {"grammar": grammar}})
    assert response.status_code == 200
    assert gw.structured() == StructuredOutput(json_schema=SCHEMA_TEXT)


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ({"type": "json", "value": [1]}, "Input validation error: grammar is not supported"),
        ({"type": "json", "value": {"type": "object"}},
         "Input validation error: grammar is not valid: Grammar must have a 'properties' field"),
        ({"type": "json", "value": {"type": 3, "properties": {}}},
         "Input validation error: grammar is not valid: 3 is not valid under any of the given "
         "schemas"),
        ({"type": "json", "value": "{oops"},
         "Input validation error: grammar is not valid: Expecting property name enclosed in "
         "double quotes: line 1 column 2 (char 1)"),
    ],
)
@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
async def test_tgi_bad_grammars_are_422_validation(
    gw: Gw, path: str, grammar: dict[str, Any], message: str
) -> None:
    body = {"inputs": "a", "parameters": {"grammar": grammar}}
    response = await gw.http.post(path, json=body)
    assert response.status_code == 422
    assert response.json() == {"error": message, "error_type": "validation"}


# ---- Triton --------------------------------------------------------------------------------------


def sampling_tensor(params: dict[str, Any]) -> dict[str, Any]:
    return {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES",
            "data": [json.dumps(params)]}


TEXT = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a b"]}


async def test_triton_structured_outputs_in_the_tensor_and_in_parameters(gw: Gw) -> None:
    spec = json.dumps({"choice": ["yes", "no"]})
    body = {"inputs": [TEXT, sampling_tensor({"structured_outputs": spec})]}
    assert (await gw.http.post("/v2/models/tiny/infer", json=body)).status_code == 200
    assert gw.structured() == StructuredOutput(choice=("yes", "no"))
    body = {"text_input": "a b", "parameters": {"structured_outputs": '{"regex": "[0-9]+"}'}}
    assert (await gw.http.post("/v2/models/tiny/generate", json=body)).status_code == 200
    assert gw.structured() == StructuredOutput(regex="[0-9]+")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"guided_json": "{}"},
         "Error generating stream: Unexpected keyword argument 'guided_json' (sampling "
         "parameters are vLLM SamplingParams fields and lora_name)"),
        ({"structured_outputs": '{"regex": "a", "choice": ["b"]}'},
         "You can only use one kind of structured outputs constraint but multiple are "
         "specified: {'regex': 'a', 'choice': ['b']}"),
        ({"structured_outputs": "{bad"},
         "parameter 'structured_outputs' must be a JSON object (as a string) with one of json, "
         "regex, choice, grammar, json_object"),
        ({"prompt_logprobs": 1},
         "sampling parameter 'prompt_logprobs' is not supported by this server (only its "
         "default, null, is accepted)"),
        ({"temperature": "warm"}, "parameter 'temperature' must be a finite number, got 'warm'"),
    ],
)
@pytest.mark.parametrize("route", ["infer", "generate", "generate_stream"])
async def test_triton_bad_sampling_parameters_are_400_errors(
    gw: Gw, route: str, params: dict[str, Any], message: str
) -> None:
    if route == "infer":
        body: dict[str, Any] = {"inputs": [TEXT, sampling_tensor(params)]}
    else:
        body = {"text_input": "a b", "parameters": params}
    response = await gw.http.post(f"/v2/models/tiny/{route}", json=body)
    assert response.status_code == 400
    assert response.json() == {"error": message}


# ---- DJL -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({"json_schema": SCHEMA}, StructuredOutput(json_schema=SCHEMA_TEXT)),
        ({"structured_outputs": {"regex": "[a-c]{3}"}}, StructuredOutput(regex="[a-c]{3}")),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
    ],
)
@pytest.mark.parametrize("path", ["/invocations", "/predictions/tiny"])
async def test_djl_constraints_reach_the_engine(
    gw: Gw, path: str, parameters: dict[str, Any], expected: StructuredOutput
) -> None:
    response = await gw.http.post(path, json={"inputs": "a", "parameters": parameters})
    assert response.status_code == 200
    assert gw.structured() == expected


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"json_schema": SCHEMA, "structured_outputs": {"regex": "a"}},
         "Input parsing failed: json_schema cannot be combined with structured_outputs or "
         "response_format: give one constraint"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "Input parsing failed: You can only use one kind of structured outputs constraint but "
         "multiple are specified: {'regex': 'a', 'json_object': True}"),
        ({"structured_outputs": {"choice": []}},
         "Input parsing failed: parameters.structured_outputs.choice must be a non-empty list "
         "of strings"),
        ({"response_format": {"type": "json_schema"}},
         "Input parsing failed: When response_format type is 'json_schema', the 'json_schema' "
         "field must be provided."),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_djl_bad_constraints_are_424_parsing_failures(
    gw: Gw, parameters: dict[str, Any], message: str, stream: bool
) -> None:
    body = {"inputs": "a", "stream": stream, "parameters": parameters}
    response = await gw.http.post("/invocations", json=body)
    assert response.status_code == 424
    assert response.json() == {"error": message, "code": 424}


async def test_djl_wrong_types_are_424(gw: Gw) -> None:
    body = {"inputs": "a", "parameters": {"structured_outputs": "json"}}
    response = await gw.http.post("/invocations", json=body)
    assert response.status_code == 424
    assert "parameters.structured_outputs" in response.json()["error"]
