"""DJL translation, error tables and routes on the fake engine (in process, no sockets)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from protocols.djl import errors, responses, translate
from protocols.djl.schema import AdapterForm, LmiParameters, LmiRequest
from server.core.errors import (
    AdapterCapacity,
    AdapterExists,
    AdapterInvalid,
    AdapterNotFound,
    EngineError,
    InvalidRequest,
    LoraDisabled,
    ModelNotFound,
    Overloaded,
    Unsupported,
)
from server.core.types import (
    Choice,
    Delta,
    FinishReason,
    GenerationResult,
    Sampling,
    SamplingDefaults,
    Started,
    StructuredOutput,
    TokenLogprob,
    Usage,
)
from server.http.context import RequestBounds
from tests.unit.demo_kit import unit_demo
from tests.unit.gateway_kit import client, make_gateway

BOUNDS = RequestBounds(max_n=4, max_best_of=4, max_stop_sequences=2, max_prompts=3)
DEMO = unit_demo()


def lmi(body: dict[str, Any]) -> LmiRequest:
    return LmiRequest.model_validate(body)


# ---- management forms and DJL JSON ---------------------------------------------------------

@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, True), (True, True), (False, False), ("true", True), ("TRUE", True), ("yes", False),
     ("1", False), ("false", False)],
)
def test_booleans_parse_like_java(value: bool | str | None, expected: bool) -> None:
    assert translate.java_bool(value, True) is expected


def test_query_parameters_win_over_the_json_body_and_extras_become_options() -> None:
    form = translate.to_form(
        {"name": "q", "rank_hint": "4"},
        {"name": "b", "src": "/s", "pin": True, "extra": {"k": 1}},
    )
    reg = translate.to_registration(form)
    assert (reg.name, reg.src, reg.pin, reg.preload) == ("q", "/s", True, True)
    assert reg.options == {"rank_hint": "4", "extra": '{"k":1}'}


@pytest.mark.parametrize("missing", ["name", "src"])
def test_missing_or_empty_required_parameter_names_it(missing: str) -> None:
    fields = {"name": "a", "src": "/s", missing: ""}
    with pytest.raises(InvalidRequest, match=f"The parameter {missing} is required"):
        translate.to_registration(translate.to_form(fields, None))


def test_wrong_type_in_json_body_is_a_validation_error() -> None:
    with pytest.raises(InvalidRequest):
        translate.to_form({}, {"name": 5, "src": "/s"})


def test_update_keeps_unset_fields_unset() -> None:
    upd = translate.to_update(AdapterForm.model_validate({"pin": "true"}))
    assert (upd.src, upd.preload, upd.pin, upd.options) == (None, None, True, {})


def test_djl_json_is_pretty_printed_with_a_trailing_newline() -> None:
    assert translate.djl_json({"status": "Adapter a1 registered"}) == (
        b'{\n  "status": "Adapter a1 registered"\n}\n'
    )


@pytest.mark.parametrize(
    ("query", "expected"),
    [({}, (0, 5, None)), ({"limit": "2"}, (0, 2, "2")), ({"limit": "2", "next_page_token": "4"},
     (4, 5, None)), ({"limit": "500"}, (0, 5, None)), ({"limit": "-1"}, (0, 5, None)),
     ({"next_page_token": "-3", "limit": "1"}, (0, 1, "1")), ({"limit": "0"}, (0, 0, "0")),
     ({"next_page_token": "9"}, (9, 5, None))],
)
def test_pagination_follows_djl(
    query: dict[str, str], expected: tuple[int, int, str | None]
) -> None:
    assert translate.page(query, 5) == expected


def test_pagination_refuses_non_integers() -> None:
    with pytest.raises(InvalidRequest, match="Invalid value for parameter limit"):
        translate.page({"limit": "ten"}, 5)


# ---- sampling and plans --------------------------------------------------------------------------

def test_lmi_defaults_are_greedy_with_30_new_tokens() -> None:
    sampling = translate.to_sampling(LmiParameters(), BOUNDS)
    assert (sampling.temperature, sampling.max_new_tokens, sampling.n) == (0.0, 30, 1)


@pytest.mark.parametrize(
    ("params", "temperature"),
    [({"do_sample": True}, 1.0), ({"do_sample": True, "temperature": 0.5}, 0.5),
     ({"temperature": 0.7}, 0.7), ({"do_sample": False, "temperature": 0.7}, 0.0)],
)
def test_do_sample_and_temperature_as_lmi_maps_them(
    params: dict[str, Any], temperature: float
) -> None:
    assert translate.to_sampling(LmiParameters(**params), BOUNDS).temperature == temperature


def test_lmi_names_map_to_vllm_knobs() -> None:
    params = LmiParameters(
        stop_sequences="END", ignore_eos_token=True, max_new_tokens=7, stop_token_ids=[2],
        top_k=5, repetition_penalty=1.1,
    )
    sampling = translate.to_sampling(params, BOUNDS)
    assert sampling.stop == ("END",) and sampling.ignore_eos and sampling.max_new_tokens == 7
    assert sampling.stop_token_ids == (2,) and sampling.top_k == 5


@pytest.mark.parametrize(
    "params",
    [{"n": 5}, {"n": 2, "best_of": 1}, {"stop_sequences": ["a", "b", "c"]}, {"stop": [""]},
     {"top_k": -2}],
)
def test_out_of_bounds_parameters_are_refused(params: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        translate.to_sampling(LmiParameters(**params), BOUNDS)


@pytest.mark.parametrize(
    "body",
    [{"inputs": 5}, {"inputs": "x", "parameters": {"max_new_tokens": 0}},
     {"inputs": "x", "parameters": {"do_sample": "yes"}}, {"inputs": "x", "stream": "true"},
     {"inputs": "x", "parameters": {"temperature": -1}}, {"parameters": {}},
     {"inputs": "x", "adapters": 3}],
)
def test_wrong_types_and_ranges_fail_validation(body: dict[str, Any]) -> None:
    from server.http.body import parse_model

    with pytest.raises(InvalidRequest):
        parse_model(LmiRequest, body)


def test_plan_has_one_request_per_input_with_its_model() -> None:
    plan = translate.to_plan(
        lmi({"inputs": ["x", "y"]}), request_id="r", models=["a1", ""], bounds=BOUNDS
    )
    assert [r.model for r in plan.requests] == ["a1", ""]
    assert not plan.single and all(r.protocol == "djl" for r in plan.requests)


def test_too_many_or_no_inputs_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="Too many inputs"):
        translate.input_texts(lmi({"inputs": ["a", "b", "c", "d"]}), BOUNDS)
    with pytest.raises(InvalidRequest, match="must not be empty"):
        translate.input_texts(lmi({"inputs": []}), BOUNDS)


def test_streaming_a_list_of_inputs_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="Streaming"):
        translate.to_plan(
            lmi({"inputs": ["x", "y"], "stream": True}), request_id="r", models=["", ""],
            bounds=BOUNDS,
        )


# ---- model defaults ------------------------------------------------------------------------------

DEFAULTS = SamplingDefaults(
    temperature=0.7, top_p=0.9, top_k=40, min_p=0.1, repetition_penalty=1.05,
    presence_penalty=0.5, frequency_penalty=0.2, max_new_tokens=64,
)


def defaulted(**params: Any) -> Sampling:
    return translate.to_sampling(LmiParameters(**params), BOUNDS, DEFAULTS)


def test_a_sampled_request_takes_every_model_default_it_leaves_out() -> None:
    s = defaulted(do_sample=True)
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.7, 0.9, 40, 0.1)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.05, 0.5, 0.2)
    assert s.max_new_tokens is None  # the model's 64, applied by the engine within the room


def test_lmi_greedy_stays_greedy_with_the_model_penalties_and_limit() -> None:
    for params in ({}, {"do_sample": False, "temperature": 0.9}):
        s = defaulted(**params)
        assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.0, 1.0, 0, 0.0)
        assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (
            1.05, 0.5, 0.2
        )
        assert s.max_new_tokens is None


def test_values_given_win_over_the_model_defaults() -> None:
    s = defaulted(temperature=0.3, top_p=0.5, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                  presence_penalty=0.0, frequency_penalty=0.0, max_new_tokens=9)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.max_new_tokens) == (0.3, 0.5, -1, 0.0, 9)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.0, 0.0, 0.0)


# ---- structured output ---------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
SCHEMA_TEXT = '{"type":"object","properties":{"a":{"enum":["x","y"]}},"required":["a"]}'


def structured(**params: Any) -> StructuredOutput | None:
    return translate.to_sampling(LmiParameters(**params), BOUNDS).structured


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, None),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(json_schema=SCHEMA_TEXT)),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredOutput(regex="[0-9]{3}")),
        ({"structured_outputs": {"choice": ["up", "down"]}},
         StructuredOutput(choice=("up", "down"))),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput(json_object=True)),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s",
                                                                      "schema": SCHEMA}}},
         StructuredOutput(json_schema=SCHEMA_TEXT)),
        ({"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}},
         StructuredOutput(regex="a")),
        # vLLM: response_format replaces the same kind of constraint
        ({"structured_outputs": {"json": {"type": "string"}},
          "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
         StructuredOutput(json_schema=SCHEMA_TEXT)),
        ({"json_schema": SCHEMA}, StructuredOutput(json_schema=SCHEMA_TEXT)),
        ({"json_schema": json.dumps(SCHEMA)}, StructuredOutput(json_schema=SCHEMA_TEXT)),
    ],
)
def test_lmi_structured_output_parameters(
    params: dict[str, Any], expected: StructuredOutput | None
) -> None:
    assert structured(**params) == expected


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
         "Input parsing failed: You can only use one kind of structured outputs constraint but "
         "multiple are specified: {'regex': 'a', 'choice': ['b']}"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "Input parsing failed: You can only use one kind of structured outputs constraint but "
         "multiple are specified: {'regex': 'a', 'json_object': True}"),
        ({"structured_outputs": {}},
         "Input parsing failed: You must use one kind of structured outputs constraint but "
         "none are specified: {}"),
        ({"json_schema": SCHEMA, "structured_outputs": {"regex": "a"}},
         "Input parsing failed: json_schema cannot be combined with structured_outputs or "
         "response_format: give one constraint"),
        ({"json_schema": SCHEMA, "response_format": {"type": "json_object"}},
         "Input parsing failed: json_schema cannot be combined with structured_outputs or "
         "response_format: give one constraint"),
        ({"response_format": {"type": "json_schema"}},
         "Input parsing failed: When response_format type is 'json_schema', the 'json_schema' "
         "field must be provided."),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "Input parsing failed: response_format.json_schema.schema must be a JSON object"),
        ({"json_schema": "{not json"},
         "Input parsing failed: parameters.json_schema is not valid JSON: Expecting property"),
        ({"structured_outputs": {"choice": "up"}},
         "Input parsing failed: parameters.structured_outputs.choice must be a non-empty list"),
        ({"structured_outputs": {"guided_json": SCHEMA}},
         "Input parsing failed: parameters.structured_outputs has unknown keys ['guided_json']"),
    ],
)
def test_bad_or_conflicting_constraints_are_lmi_parsing_failures(
    params: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        structured(**params)
    assert caught.value.message.startswith(message)
    assert errors.inference_error(caught.value) == (
        424, {"error": caught.value.message, "code": 424}
    )


def test_constraints_the_server_cannot_apply_are_unsupported() -> None:
    for params in ({"response_format": {"type": "structural_tag"}},
                   {"structured_outputs": {"structural_tag": "{}"}}):
        with pytest.raises(Unsupported, match=r"^Input parsing failed: .*not supported"):
            structured(**params)


def test_structured_output_fields_are_type_checked() -> None:
    from server.http.body import parse_model

    for params in ({"structured_outputs": "json"}, {"response_format": ["json_object"]},
                   {"json_schema": 3}):
        with pytest.raises(InvalidRequest):
            parse_model(LmiRequest, {"inputs": "x", "parameters": params})


# ---- responses ----------------------------------------------------------------------------------

def choice(index: int, text: str, ids: tuple[int, ...], reason: FinishReason = FinishReason.LENGTH,
           stop: str | int | None = None) -> Choice:
    logprobs = tuple(TokenLogprob(token_id=i, token=f"t{i}", logprob=-0.5) for i in ids)
    return Choice(index=index, text=text, finish_reason=reason, token_ids=ids, logprobs=logprobs,
                  matched_stop=stop)


def result(*choices: Choice) -> GenerationResult:
    return GenerationResult(request_id="r", model="", prompts=(Started(prompt_token_ids=(1, 2)),),
                            choices=choices, usage=Usage(prompt_tokens=2, completion_tokens=2))


def plan_of(body: dict[str, Any], *, legacy: bool, models: tuple[str, ...] = ("",)
            ) -> translate.Plan:
    return translate.to_plan(lmi(body), request_id="r", models=list(models), bounds=BOUNDS,
                             legacy=legacy)


DETAILED = {"inputs": "hi", "parameters": {"details": True, "return_full_text": True, "seed": 5}}


def test_async_schema_is_the_default_object_with_lmis_async_details() -> None:
    """request_response_utils.py convert_completion_response_to_lmi_schema."""
    plan = translate.to_plan(lmi(DETAILED), request_id="r", models=[""], bounds=BOUNDS)
    out = responses.to_response(result(choice(0, " there", (7, 8))), plan)
    assert out == {
        "generated_text": "hi there",
        "details": {
            "finish_reason": "length", "generated_tokens": 2, "seed": 5, "prefill": [],
            "tokens": [{"id": 7, "text": "t7", "logprob": -0.5},
                       {"id": 8, "text": "t8", "logprob": -0.5}],
        },
    }
    plain = responses.to_response(result(choice(0, "x", (7,))), plan_of({"inputs": "hi"},
                                                                          legacy=False))
    assert plain == {"generated_text": "x"}


def test_async_prefill_leaves_out_the_first_prompt_token() -> None:
    body = {"inputs": "hi", "parameters": {"details": True, "decoder_input_details": True}}
    prompt = Started(prompt_token_ids=(1, 9), prompt_logprobs=(
        None, TokenLogprob(token_id=9, token="x", logprob=-2.0)))
    done = GenerationResult(request_id="r", model="", prompts=(prompt,),
                            choices=(choice(0, "a", (7,)),),
                            usage=Usage(prompt_tokens=2, completion_tokens=1))
    details = responses.to_response(done, plan_of(body, legacy=False), [["<s>", "hi"]])
    legacy = responses.to_response(done, plan_of(body, legacy=True), [["<s>", "hi"]])
    assert isinstance(details, dict) and isinstance(legacy, dict)
    assert details["details"]["prefill"] == [{"id": 9, "text": "hi", "logprob": -2.0}]
    assert legacy["details"]["prefill"] == [{"id": 1, "text": "<s>", "log_prob": None},
                                            {"id": 9, "text": "hi", "log_prob": -2.0}]


def test_each_input_of_a_list_gets_its_own_prefill() -> None:
    """LMI runs a list's inputs as separate requests, each with `decoder_input_details`."""
    body = {"inputs": ["hi", "yo"],
            "parameters": {"details": True, "decoder_input_details": True}}
    plan = plan_of(body, legacy=False, models=("", ""))
    assert [r.output.prompt_logprobs for r in plan.requests] == [0, 0]
    prompts = tuple(
        Started(prompt_token_ids=(1, tid), prompt_index=k,
                prompt_logprobs=(None, TokenLogprob(token_id=tid, token="x", logprob=-1.0 - k)))
        for k, tid in enumerate((9, 11))
    )
    done = GenerationResult(request_id="r", model="", prompts=prompts,
                            choices=(choice(0, "a", (7,)), choice(1, "b", (8,))),
                            usage=Usage(prompt_tokens=4, completion_tokens=2))
    out = responses.to_response(done, plan, [["<s>", "hi"], ["<s>", "yo"]])
    assert isinstance(out, list)
    assert [o["details"]["prefill"] for o in out] == [
        [{"id": 9, "text": "hi", "logprob": -1.0}], [{"id": 11, "text": "yo", "logprob": -2.0}]]


def test_rolling_batch_schema_answers_lmis_legacy_details() -> None:
    out = responses.to_response(result(choice(0, " there", (7, 8))), plan_of(DETAILED, legacy=True))
    assert out == {
        "generated_text": "hi there",
        "details": {
            "finish_reason": "length", "generated_tokens": 2, "inputs": "hi",
            "tokens": [{"id": 7, "text": "t7", "log_prob": -0.5},
                       {"id": 8, "text": "t8", "log_prob": -0.5}],
        },
    }


@pytest.mark.parametrize("legacy", [False, True])
def test_list_of_inputs_answers_one_object_per_input_in_order(legacy: bool) -> None:
    plan = plan_of({"inputs": ["a", "b"]}, legacy=legacy, models=("", "a1"))
    out = responses.to_response(result(choice(1, "B", (2,)), choice(0, "A", (1,))), plan)
    assert out == [{"generated_text": "A"}, {"generated_text": "B"}]


@pytest.mark.parametrize(
    ("reason", "stop", "legacy", "async_"),
    [(FinishReason.LENGTH, None, "length", "length"),
     (FinishReason.STOP, None, "eos_token", "stop"),
     (FinishReason.STOP, "END", "stop_sequence", "stop"),
     (FinishReason.STOP, 2, "eos_token", "stop"),
     (FinishReason.ABORT, None, "abort", "abort")],
)
def test_finish_reasons_per_schema(
    reason: FinishReason, stop: str | int | None, legacy: str, async_: str
) -> None:
    done = result(choice(0, "x", (7,), reason, stop))
    for is_legacy, expected in ((True, legacy), (False, async_)):
        out = responses.to_response(done, plan_of({"inputs": "hi", "parameters": {
            "details": True}}, legacy=is_legacy))
        assert isinstance(out, dict) and out["details"]["finish_reason"] == expected


def stream(legacy: bool, **parameters: Any) -> responses.StreamEncoder:
    plan = plan_of({"inputs": "hi", "stream": True, "parameters": parameters}, legacy=legacy)
    encoder = responses.StreamEncoder(plan)
    encoder.started(Started(prompt_token_ids=(1, 2, 3)))
    return encoder


def lines_of(encoder: responses.StreamEncoder) -> list[bytes]:
    first = list(encoder.lines(Delta(choice=0, text="ab", token_ids=(1, 2))))
    last = list(encoder.lines(Delta(choice=0, text="c", token_ids=(3,), finish=FinishReason.STOP)))
    return first + last


@pytest.mark.parametrize("legacy", [False, True])
def test_encode_writes_what_lines_write(legacy: bool) -> None:
    """`encode` (one token without the generator) and `lines` agree on every delta shape."""
    deltas = [
        Delta(choice=0, text="ab", token_ids=(1, 2)),
        Delta(choice=0, text="c", token_ids=(3,),
              logprobs=(TokenLogprob(token_id=3, token="c", logprob=-0.25),)),
        Delta(choice=0, text="", token_ids=()),
        Delta(choice=0, text="d", token_ids=(4,), finish=FinishReason.STOP),
    ]
    by_lines, by_encode = stream(legacy, details=True), stream(legacy, details=True)
    for delta in deltas:
        assert by_encode.encode(delta) == b"".join(by_lines.lines(delta))


def test_async_stream_lines_carry_index_logprob_and_nulls_until_the_end() -> None:
    """request_response_utils.py convert_completion_chunk_response_to_lmi_schema."""
    raw = lines_of(stream(False, details=True, seed=4, return_full_text=True))
    lines = [json.loads(x) for x in raw]
    assert all(x.endswith(b"\n") and x.count(b"\n") == 1 for x in raw)
    assert lines[0] == {"index": 0, "token": {"id": 1, "text": "", "logprob": None},
                        "generated_text": None, "details": None}
    assert [line["token"]["text"] for line in lines] == ["", "ab", "c"]
    assert lines[-1]["generated_text"] == "hiabc"
    assert lines[-1]["details"] == {"finish_reason": "stop", "seed": 4, "generated_tokens": 3,
                                    "input_length": 3}
    plain = [json.loads(x) for x in lines_of(stream(False))]
    assert plain[-1]["details"] is None and plain[-1]["generated_text"] == "abc"


def test_rolling_batch_stream_lines_put_text_on_the_last_token() -> None:
    lines = [json.loads(x) for x in lines_of(stream(True, details=True))]
    assert [line["token"]["text"] for line in lines] == ["", "ab", "c"]
    assert lines[0] == {"token": {"id": 1, "text": "", "log_prob": None}}
    assert lines[-1]["generated_text"] == "abc"
    assert lines[-1]["details"] == {"finish_reason": "eos_token", "generated_tokens": 3,
                                    "inputs": "hi"}


def test_a_stream_error_is_the_schemas_error_line() -> None:
    legacy = json.loads(stream(True).error("boom", 424))
    assert legacy["details"] == {"finish_reason": "error"} and legacy["error"] == "boom"
    assert json.loads(stream(False).error("boom", 424)) == {"error": {
        "message": "boom", "type": "InternalServerError", "param": None, "code": 500}}
    gone = json.loads(stream(False).error("draining", 503))
    assert (gone["error"]["type"], gone["error"]["code"]) == ("ServiceUnavailableError", 503)


# ---- error tables ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("exc", "status", "java_type"),
    [(InvalidRequest("x"), 400, "BadRequestException"),
     (AdapterInvalid("x"), 424, "BadRequestException"),  # the handler failed (DJL's 424)
     (LoraDisabled("LoRA is not enabled."), 400, "BadRequestException"),
     (AdapterNotFound("x"), 404, "BadRequestException"),
     (AdapterExists("x"), 409, "IllegalArgumentException"),
     (AdapterCapacity("No free lora slots"), 507, "BadRequestException"),
     (Overloaded(), 503, "WlmCapacityException"),
     (errors.MethodNotAllowed(), 405, "MethodNotAllowedException"),
     (EngineError("x"), 500, "InternalServerException")],
)
def test_management_error_table(exc: Any, status: int, java_type: str) -> None:
    response = errors.render_management(exc)
    assert response.status_code == status
    assert json.loads(response.body) == {"code": status, "type": java_type, "message": exc.message}
    assert bytes(response.body).endswith(b"}\n")


@pytest.mark.parametrize(
    ("exc", "status", "body"),
    [(AdapterNotFound("Adapter z is not registered"), 424,
      {"error": "Adapter z is not registered", "code": 424}),
     (InvalidRequest("bad"), 424, {"error": "bad", "code": 424}),
     (ModelNotFound("Model or workflow not found: m"), 404,
      {"code": 404, "type": "ModelNotFoundException", "message": "Model or workflow not found: m"}),
     (EngineError("died"), 424,
      {"code": 424, "message": "invoke handler failure", "error": "died"})],
)
def test_inference_error_table(exc: Any, status: int, body: dict[str, Any]) -> None:
    assert errors.inference_error(exc) == (status, body)


# ---- routes in process (fake engine) ------------------------------------------------------------

@pytest.fixture
async def gw() -> AsyncIterator[Any]:
    gateway = make_gateway(overrides={"LoraConfig": {
        "adapterDir": str(DEMO / "adapters"), "adapterRoots": [str(DEMO)]}})
    from server.gateway import register_startup_adapters

    await register_startup_adapters(gateway)
    yield gateway


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("rolling_batch", "detail_keys", "token_keys"),
    [("auto", {"finish_reason", "generated_tokens", "seed", "prefill", "tokens"},
      {"id", "text", "logprob"}),
     ("vllm", {"finish_reason", "generated_tokens", "inputs", "tokens"},
      {"id", "text", "log_prob"})],
)
async def test_the_lmi_schema_follows_rolling_batch(
    rolling_batch: str, detail_keys: set[str], token_keys: set[str]
) -> None:
    gateway = make_gateway(overrides={"ProtocolConfig": {"rollingBatch": rolling_batch}})
    body = {"inputs": "a b", "parameters": {"max_new_tokens": 3, "details": True}}
    async with client(gateway, "data") as http:
        answer = (await http.post("/invocations", json=body)).json()
        streamed = await http.post("/predictions/tiny", json={**body, "stream": True})
    assert set(answer["details"]) == detail_keys
    assert all(set(t) == token_keys for t in answer["details"]["tokens"])
    lines = [json.loads(line) for line in streamed.text.splitlines()]
    assert all(set(line["token"]) == token_keys for line in lines)
    assert lines[-1]["generated_text"] == answer["generated_text"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("params", "status", "words"),
    [({"src": "/nowhere/a9"}, 424, "outside the allowed adapter roots"),
     ({"src": "{demo}/test-adapters/nope"}, 424, "not a directory"),
     ({"src": "{demo}/test-adapters/a4", "preload": "false", "pin": "true"}, 424,
      "Can not set preload to false and pin to true"),
     ({"src": ""}, 400, "The parameter src is required"),
     ({"src": "{demo}/test-adapters/a4", "name": "bad name!"}, 400, "Invalid adapter name")],
)
async def test_a_registration_the_handler_refuses_is_djls_424(
    gw: Any, params: dict[str, str], status: int, words: str
) -> None:
    """adapter_manager_mixin.py answers code 424 for what register_adapter refuses; the Java
    front's own checks (required parameters) stay 400."""
    query = {"name": "a9", **{k: v.format(demo=DEMO) for k, v in params.items()}}
    async with client(gw, "management") as http:
        response = await http.post("/models/tiny/adapters", params=query)
        assert response.status_code == status
        body = response.json()
        assert (body["code"], body["type"]) == (status, "BadRequestException")
        assert words in body["message"]
        assert (await http.get("/adapters/a9")).status_code == 404


@pytest.mark.anyio
async def test_other_methods_get_djl_405(gw: Any) -> None:
    async with client(gw, "management") as http:
        for method, path in [("PUT", "/adapters"), ("POST", "/adapters/a1"),
                             ("GET", "/models/tiny/adapters/a1/update")]:
            response = await http.request(method, path)
            assert response.status_code == 405
            assert response.json()["type"] == "MethodNotAllowedException"


@pytest.mark.anyio
async def test_register_with_json_body_answers_text_and_with_query_djl_json(gw: Any) -> None:
    src = str(DEMO / "test-adapters")
    async with client(gw, "management") as http:
        text = await http.post("/adapters", json={"name": "a4", "src": f"{src}/a4"})
        djl = await http.post("/adapters", params={"name": "a5", "src": f"{src}/a5"})
        both = await http.post("/adapters", json={"name": "a6", "src": f"{src}/a6"},
                               headers={"accept": "application/json",
                                        "x-amzn-sagemaker-adapter-alias": "six"})
    assert (text.status_code, text.text) == (200, "Adapter a4 registered")
    assert djl.text == '{\n  "status": "Adapter a5 registered"\n}\n'
    assert both.json() == {"status": "Adapter six registered"}


@pytest.mark.anyio
async def test_ping_reports_the_model_healthy(gw: Any) -> None:
    async with client(gw, "data") as http:
        response = await http.get("/ping")
    assert response.status_code == 200
    assert response.json() == {"tiny": {"status": "Healthy"}}


@pytest.mark.anyio
async def test_ping_is_503_while_draining(gw: Any) -> None:
    gw.lifecycle.begin_drain()
    async with client(gw, "data") as http:
        response = await http.get("/ping")
    assert response.status_code == 503


@pytest.mark.anyio
async def test_lora_disabled_answers_400_on_every_adapter_route() -> None:
    gateway = make_gateway(overrides={"LoraConfig": {"enabled": False}})
    async with client(gateway, "management") as http:
        for method, path in [("GET", "/adapters"), ("POST", "/adapters?name=a&src=/x"),
                             ("GET", "/models/tiny/adapters/a1"), ("DELETE", "/adapters/a1"),
                             ("POST", "/adapters/a1/update")]:
            response = await http.request(method, path)
            assert response.status_code == 400
            assert response.json() == {"code": 400, "type": "BadRequestException",
                                       "message": "LoRA is not enabled."}
