"""Structured output on TGI, Triton and DJL, end to end on the real server process and the REAL
vLLM engine, with each protocol's official client where it has one (`text_generation` and
`huggingface_hub` for TGI, `tritonclient.http` for Triton, plain HTTP for DJL).

The output really is constrained: JSON is parsed and validated against its schema, a regex
matches the whole output, a choice is one of the choices. Every bad input (a malformed grammar,
wrong types, unknown keys, conflicting constraints, a pattern the engine cannot compile) gets the
protocol's own error shape, never a 500, and the engine serves right after.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest
import tritonclient.http as triton
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError as HubValidationError
from text_generation import Client
from text_generation.errors import ValidationError as TgiValidationError
from text_generation.types import Grammar, GrammarType
from tritonclient.utils import InferenceServerException

from tests.serverproc import RunningServer

pytestmark = [pytest.mark.server, pytest.mark.engine]

PROMPT = "Answer in JSON:"
SCHEMA = {
    "type": "object",
    "properties": {"mood": {"enum": ["good", "bad"]}},
    "required": ["mood"],
    "additionalProperties": False,
}
BUDGET = 200  # the demo model writes JSON whitespace freely; it closes the object well before
REGEX = "[0-9]{3}-[a-c]{2}"
CHOICES = ["Positive", "Negative"]


@pytest.fixture(scope="module")
def http(live_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=120) as client:
        yield client


def valid_json(text: str) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def assert_still_serving(http: httpx.Client) -> None:
    response = http.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 4}})
    assert response.status_code == 200, response.text


# ---- TGI ---------------------------------------------------------------------------------------


def test_tgi_json_grammar_with_text_generation(live_server: RunningServer) -> None:
    tgi = Client(live_server.url, timeout=120)
    grammar = Grammar(type=GrammarType.Json, value=SCHEMA)
    out = tgi.generate(PROMPT, max_new_tokens=BUDGET, grammar=grammar)
    assert valid_json(out.generated_text)["mood"] in {"good", "bad"}
    assert out.details.finish_reason != "length"


def test_tgi_json_schema_grammar_streamed_with_huggingface_hub(
    live_server: RunningServer,
) -> None:
    hub = InferenceClient(base_url=live_server.url, timeout=120)
    grammar = {"type": "json_schema", "value": {"name": "mood", "schema": SCHEMA}}
    pieces = hub.text_generation(PROMPT, max_new_tokens=BUDGET, grammar=grammar, stream=True,
                                 do_sample=True, seed=3)
    valid_json("".join(pieces))


def test_tgi_regex_grammar_with_huggingface_hub(live_server: RunningServer) -> None:
    hub = InferenceClient(base_url=live_server.url, timeout=120)
    text = hub.text_generation(PROMPT, max_new_tokens=20, return_full_text=False,
                               grammar={"type": "regex", "value": REGEX})
    assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ({"type": "json", "value": [SCHEMA]}, "grammar is not supported"),
        ({"type": "json", "value": {"type": "object"}},
         "grammar is not valid: Grammar must have a 'properties' field"),
        ({"type": "json", "value": {"type": "frog", "properties": {}}},
         "grammar is not valid: 'frog' is not valid under any of the given schemas"),
        ({"type": "regex", "value": "(ab"},  # the engine's own check
         "Failed to transform regex into a grammar: Regex parsing error at position 4"),
    ],
)
@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
def test_tgi_bad_grammars_are_422_validation_errors(
    http: httpx.Client, path: str, grammar: dict[str, Any], message: str
) -> None:
    response = http.post(path, json={"inputs": PROMPT, "parameters": {"grammar": grammar}})
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error_type"] == "validation" and set(body) == {"error", "error_type"}
    assert body["error"].startswith("Input validation error: " + message), body
    assert_still_serving(http)


def test_tgi_clients_raise_their_validation_errors(live_server: RunningServer) -> None:
    bad = {"type": "json", "value": {"type": "object"}}
    with pytest.raises(TgiValidationError, match="Grammar must have a 'properties' field"):
        Client(live_server.url, timeout=120).generate(PROMPT, grammar=Grammar(**bad))
    hub = InferenceClient(base_url=live_server.url, timeout=120)
    with pytest.raises(HubValidationError, match="grammar is not supported"):
        hub.text_generation(PROMPT, grammar={"type": "json", "value": 3})


# ---- Triton ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tritons(live_server: RunningServer) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(f"127.0.0.1:{live_server.data_port}",
                                          network_timeout=120)
    yield client
    client.close()


def triton_text(client: triton.InferenceServerClient, sampling: dict[str, Any]) -> str:
    inputs = []
    for name, datatype, value in (
        ("text_input", "BYTES", np.array([PROMPT.encode()], dtype=np.object_)),
        ("sampling_parameters", "BYTES",
         np.array([json.dumps(sampling).encode()], dtype=np.object_)),
        ("exclude_input_in_output", "BOOL", np.array([True], dtype=bool)),
    ):
        tensor = triton.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    out: bytes = client.infer("tiny", inputs).as_numpy("text_output")[0]
    return out.decode()


def test_triton_choice_in_the_sampling_parameters_tensor(
    tritons: triton.InferenceServerClient,
) -> None:
    spec = json.dumps({"choice": CHOICES})
    for seed in (1, 2, 3):
        text = triton_text(tritons, {"structured_outputs": spec, "max_tokens": 20, "seed": seed})
        assert text in CHOICES


def test_triton_json_schema_in_the_sampling_parameters_tensor(
    tritons: triton.InferenceServerClient,
) -> None:
    spec = json.dumps({"json": SCHEMA})
    valid_json(triton_text(tritons, {"structured_outputs": spec, "max_tokens": BUDGET}))


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_triton_regex_in_generate_parameters(http: httpx.Client, route: str) -> None:
    body = {"text_input": PROMPT, "exclude_input_in_output": True, "stream": False,
            "parameters": {"structured_outputs": json.dumps({"regex": REGEX}),
                           "max_tokens": 20}}
    response = http.post(f"/v2/models/tiny/{route}", json=body)
    assert response.status_code == 200, response.text
    payload = response.text.removeprefix("data: ") if route == "generate_stream" else (
        response.text
    )
    text = json.loads(payload)["text_output"]
    assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"guided_json": json.dumps(SCHEMA)},
         "Error generating stream: Unexpected keyword argument 'guided_json'"),
        ({"structured_outputs": json.dumps({"regex": "a", "choice": CHOICES})},
         "You can only use one kind of structured outputs constraint but multiple are specified"),
        ({"structured_outputs": json.dumps({"choice": "Positive"})},
         "structured_outputs.choice must be a non-empty list of strings"),
        ({"structured_outputs": "{not json"}, "parameter 'structured_outputs' must be a JSON"),
        ({"max_tokens": "many"}, "parameter 'max_tokens' must be an integer"),
        ({"prompt_logprobs": 1}, "sampling parameter 'prompt_logprobs' is not supported"),
        ({"structured_outputs": json.dumps({"regex": "(ab"})},
         "Failed to transform regex into a grammar: Regex parsing error"),
    ],
)
def test_triton_bad_sampling_parameters_are_400s_through_tritonclient(
    tritons: triton.InferenceServerClient, http: httpx.Client, sampling: dict[str, Any],
    message: str,
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        triton_text(tritons, sampling)
    assert caught.value.status() == "400"
    assert (caught.value.message() or "").startswith(message), caught.value.message()
    assert_still_serving(http)


def test_triton_bad_generate_parameters_are_400_json_errors(http: httpx.Client) -> None:
    body = {"text_input": PROMPT, "parameters": {"sequence_id": 1, "typo_tokens": 3}}
    response = http.post("/v2/models/tiny/generate_stream", json=body)
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"].startswith(
        "Error generating stream: Unexpected keyword argument 'typo_tokens'"
    )


def test_triton_knows_every_sampling_params_field_of_the_installed_vllm() -> None:
    from vllm.sampling_params import SamplingParams

    from protocols.kserve_v2.sampling import KNOWN

    fields = {name for name in SamplingParams.__struct_fields__ if not name.startswith("_")}
    assert fields | {"lora_name"} <= KNOWN, sorted(fields - KNOWN)


# ---- DJL ---------------------------------------------------------------------------------------


def lmi(http: httpx.Client, parameters: dict[str, Any], **body: Any) -> httpx.Response:
    return http.post("/invocations", json={"inputs": PROMPT, "parameters": parameters, **body})


@pytest.mark.parametrize(
    "constraint",
    [
        {"json_schema": SCHEMA},
        {"json_schema": json.dumps(SCHEMA)},
        {"structured_outputs": {"json": SCHEMA}},
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "mood", "schema": SCHEMA}}},
    ],
)
def test_djl_json_schema_constrains_the_output(
    http: httpx.Client, constraint: dict[str, Any]
) -> None:
    response = lmi(http, {"max_new_tokens": BUDGET, **constraint})
    assert response.status_code == 200, response.text
    valid_json(response.json()["generated_text"])


def test_djl_regex_and_choice_on_predictions(http: httpx.Client) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 20,
                                             "structured_outputs": {"regex": REGEX}}}
    response = http.post("/predictions/tiny", json=body)
    assert response.status_code == 200, response.text
    assert re.fullmatch(REGEX, response.json()["generated_text"])
    response = lmi(http, {"max_new_tokens": 20, "do_sample": True,
                          "structured_outputs": {"choice": CHOICES}})
    assert response.json()["generated_text"] in CHOICES


def test_djl_streamed_json_schema(http: httpx.Client) -> None:
    response = lmi(http, {"max_new_tokens": BUDGET, "json_schema": SCHEMA}, stream=True)
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in response.text.splitlines()]
    text = "".join(line["token"]["text"] for line in lines)
    assert text == lines[-1]["generated_text"]
    valid_json(text)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"json_schema": SCHEMA, "structured_outputs": {"regex": "a"}},
         "Input parsing failed: json_schema cannot be combined with structured_outputs or "
         "response_format"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "Input parsing failed: You can only use one kind of structured outputs constraint"),
        ({"structured_outputs": {"choice": 3}},
         "Input parsing failed: parameters.structured_outputs.choice must be a non-empty list"),
        ({"json_schema": [1]}, "2 validation errors"),
        ({"json_schema": {"type": "object", "properties": {"a": {"type": "frog"}}}},
         'Failed to transform json schema into a grammar: Unsupported type "frog"'),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "Invalid grammar"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "Invalid grammar"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_djl_bad_constraints_are_424s(
    http: httpx.Client, parameters: dict[str, Any], message: str, stream: bool
) -> None:
    response = lmi(http, {"max_new_tokens": 5, **parameters}, stream=stream)
    assert response.status_code == 424, response.text
    body = response.json()
    assert set(body) == {"error", "code"} and body["code"] == 424
    assert body["error"].startswith(message), body
    assert_still_serving(http)


# grammars xgrammar refuses but guidance takes: vLLM's `auto` checked them with guidance, then the
# engine compiled them with xgrammar (its one backend) and failed: they were 500s
@pytest.mark.parametrize("grammar", ["root ::= ", 'root ::= "a" | ', 'root ::= "a"\nroot ::= "b"'])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_grammars_the_engine_cannot_compile_are_openai_400s(
    http: httpx.Client, path: str, grammar: str
) -> None:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2,
                            "structured_outputs": {"grammar": grammar}}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith("Invalid grammar"), response.text
    assert_still_serving(http)
