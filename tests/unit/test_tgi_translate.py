"""TGI translation and error table, without a server: validation bounds and messages, sampling
decisions, response and stream shapes, /tokenize offsets and /info."""

from __future__ import annotations

from typing import Any

import pytest

from protocols.tgi import errors, translate
from protocols.tgi.schema import GenerateRequest
from server.core.budget import Budget, fit
from server.core.errors import (
    AdapterNotFound,
    EngineError,
    GatewayError,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
    ServiceUnavailable,
    Unsupported,
)
from server.core.types import (
    Choice,
    Delta,
    EngineInfo,
    FinishReason,
    GenerationResult,
    SamplingDefaults,
    Started,
    StructuredOutput,
    TextPrompt,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from server.http import jsonio
from server.http.context import RequestBounds

LIMITS = translate.Limits(max_input_tokens=511, max_total_tokens=512)
EOS = 2


def body(inputs: str = "Hello", **parameters: Any) -> GenerateRequest:
    return GenerateRequest.model_validate({"inputs": inputs, "parameters": parameters})


def plan_of(stream: bool = False, **parameters: Any) -> translate.Plan:
    return translate.plan(body(**parameters), LIMITS, stream=stream)


def rejection(stream: bool = False, **parameters: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        plan_of(stream, **parameters)
    return caught.value


# ---- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"temperature": 0}, "`temperature` must be strictly positive"),
        ({"temperature": -1.5}, "`temperature` must be strictly positive"),
        ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
        ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"top_p": 0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
        ({"top_k": 0}, "`top_k` must be strictly positive"),
        ({"top_k": -3}, "`top_k` must be strictly positive"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
        ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
        ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
        ({"best_of": 0}, "`best_of` must be > 0 and <= 2. Given: 0"),
        ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
        ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
        ({"truncate": 0}, "`truncate` must be strictly positive and less than 511. Given: 0"),
        ({"truncate": 600}, "`truncate` must be strictly positive and less than 511. Given: 600"),
    ],
)
def test_out_of_range_parameters_get_tgi_messages(parameters: dict[str, Any], message: str) -> None:
    assert rejection(**parameters).message == message


def test_the_error_names_the_parameter() -> None:
    assert rejection(top_p=2.0).param == "parameters.top_p"


def test_empty_inputs_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="`inputs` cannot be empty"):
        translate.plan(body(""), LIMITS, stream=False)


def test_streams_refuse_best_of_and_decoder_input_details() -> None:
    assert "not supported when streaming" in rejection(True, best_of=2, do_sample=True).message
    assert "not supported when streaming" in rejection(True, decoder_input_details=True).message


def test_watermark_is_reported_unsupported() -> None:
    with pytest.raises(Unsupported):
        plan_of(watermark=True)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}}}
PERSON_TEXT = '{"type":"object","properties":{"name":{"type":"string"}}}'


@pytest.mark.parametrize(
    ("grammar", "expected"),
    [
        ({"type": "regex", "value": "[0-9]+"}, StructuredOutput(regex="[0-9]+")),
        ({"type": "json", "value": PERSON}, StructuredOutput(json_schema=PERSON_TEXT)),
        ({"type": "json_object", "value": PERSON}, StructuredOutput(json_schema=PERSON_TEXT)),
        ({"type": "json", "value": jsonio.dumps(PERSON).decode()},
         StructuredOutput(json_schema=PERSON_TEXT)),
        (
            {"type": "json_schema", "value": {"name": "x", "schema": PERSON, "strict": True}},
            StructuredOutput(json_schema=PERSON_TEXT),
        ),
    ],
)
def test_grammar_becomes_structured_output(
    grammar: dict[str, Any], expected: StructuredOutput
) -> None:
    assert plan_of(grammar=grammar).sampling.structured == expected


@pytest.mark.parametrize(
    "grammar",
    [
        {"type": "ebnf", "value": "x"},
        {"type": "regex", "value": 3},
        {"type": "json"},
        {"type": "json_schema", "value": {"name": "x"}},
        {"type": "json_schema", "value": "{}"},
    ],
)
def test_a_grammar_of_another_shape_is_a_validation_error(grammar: dict[str, Any]) -> None:
    assert rejection(grammar=grammar).message.startswith("`grammar` must be {type: json|")


@pytest.mark.parametrize("value", [[PERSON], 3, True, None])
def test_a_json_grammar_that_is_neither_object_nor_string_is_not_supported(value: Any) -> None:
    error = rejection(grammar={"type": "json", "value": value})
    assert error.message == "grammar is not supported"
    assert error.param == "parameters.grammar"


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ({"type": "json", "value": {"type": "object"}},
         "grammar is not valid: Grammar must have a 'properties' field"),
        ({"type": "json_schema", "value": {"schema": {"type": "integer"}}},
         "grammar is not valid: Grammar must have a 'properties' field"),
        ({"type": "json", "value": {"type": "frog", "properties": {}}},
         "grammar is not valid: 'frog' is not valid under any of the given schemas"),
        ({"type": "json", "value": {"properties": {"a": {"minLength": -1}}}},
         "grammar is not valid: -1 is less than the minimum of 0"),
        ({"type": "json_schema", "value": {"schema": "text"}},
         "grammar is not valid: 'text' is not of type 'object', 'boolean'"),
        ({"type": "json", "value": "[1]"},
         "grammar is not valid: [1] is not of type 'object', 'boolean'"),
    ],
)
def test_invalid_json_schemas_get_tgi_messages(grammar: dict[str, Any], message: str) -> None:
    assert rejection(grammar=grammar).message == message


def test_a_json_grammar_string_that_is_not_json_is_not_valid() -> None:
    message = rejection(grammar={"type": "json", "value": "{nope"}).message
    assert message.startswith("grammar is not valid: Expecting property name")


def test_grammar_errors_render_as_tgi_validation_errors() -> None:
    status, body = errors.classify(rejection(grammar={"type": "json", "value": 3}))
    assert status == 422
    assert body == {
        "error": "Input validation error: grammar is not supported", "error_type": "validation"
    }


def test_watermark_false_is_accepted() -> None:
    plan_of(watermark=False)


def test_stop_limits_follow_the_server_bounds_when_tighter() -> None:
    limits = translate.Limits.of(RequestBounds(max_stop_sequences=2), 512)
    with pytest.raises(InvalidRequest, match="up to 2 stop sequences"):
        translate.plan(body(stop=["a", "b", "c"]), limits, stream=False)
    assert limits.max_input_tokens == 511 and limits.max_total_tokens == 512


# ---- sampling decisions -------------------------------------------------------------------------


def test_absent_parameters_mean_sampling_as_in_tgi() -> None:
    plan = translate.plan(GenerateRequest(inputs="Hi"), LIMITS, stream=False)
    assert plan.sampling.temperature == 1.0


def test_present_parameters_without_do_sample_are_greedy() -> None:
    assert plan_of(max_new_tokens=5).sampling.temperature == 0.0


def test_explicit_neutral_temperature_stays_greedy() -> None:
    assert plan_of(temperature=1.0).sampling.temperature == 0.0


def test_a_warper_turns_sampling_on() -> None:
    sampling = plan_of(temperature=0.5, top_k=10, top_p=0.9).sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.5, 10, 0.9)


DEFAULTS = SamplingDefaults(
    temperature=0.7, top_p=0.9, top_k=40, min_p=0.1, repetition_penalty=1.05,
    presence_penalty=0.5, frequency_penalty=0.2, max_new_tokens=64,
)


def planned(stream: bool = False, **parameters: Any) -> translate.Plan:
    return translate.plan(body(**parameters), LIMITS, stream=stream, defaults=DEFAULTS)


def test_a_sampled_request_takes_the_model_defaults_for_what_it_leaves_out() -> None:
    sampling = planned(do_sample=True).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.7, 0.9, 40)
    assert (sampling.repetition_penalty, sampling.frequency_penalty) == (1.05, 0.2)
    # TGI has no min_p or presence_penalty: the model's values are not applied
    assert (sampling.min_p, sampling.presence_penalty) == (0.0, 0.0)
    default = translate.plan(GenerateRequest(inputs="Hi"), LIMITS, stream=False,
                             defaults=DEFAULTS)
    assert default.sampling.temperature == 0.7  # no parameters: TGI samples


def test_what_the_request_gives_wins_over_the_model_defaults() -> None:
    sampling = planned(temperature=0.3, top_p=0.5, top_k=3, repetition_penalty=1.2,
                       frequency_penalty=0.0).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.3, 0.5, 3)
    assert (sampling.repetition_penalty, sampling.frequency_penalty) == (1.2, 0.0)


def test_a_greedy_request_stays_greedy_but_takes_the_default_penalties() -> None:
    for parameters in ({"do_sample": False}, {"max_new_tokens": 5}):
        sampling = planned(**parameters).sampling
        assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.0, 1.0, 0)
        assert (sampling.repetition_penalty, sampling.frequency_penalty) == (1.05, 0.2)


def test_max_new_tokens_defaults_to_the_models_limit_within_the_room() -> None:
    def fitted_max(plan: translate.Plan, prompt_tokens: int) -> int | None:
        return fitted(plan, prompt_tokens, default=64).max_tokens

    assert fitted_max(planned(), 3) == 64
    assert fitted_max(planned(), 500) == 12  # 512 - 500: a default never makes it too long
    assert fitted_max(planned(max_new_tokens=100), 3) == 100
    assert fitted(plan_of(), 3).max_tokens == 509  # no model default: the rest of the context


def test_stop_sequences_stay_in_the_text_like_tgi() -> None:
    sampling = plan_of(stop=["\n"]).sampling
    assert sampling.stop == ("\n",) and sampling.include_stop_str_in_output


def test_details_ask_for_sampled_logprobs_and_prefill_for_prompt_logprobs() -> None:
    assert plan_of().output.logprobs is None
    assert plan_of(details=True).output.logprobs == 0
    assert plan_of(details=True, top_n_tokens=3).output.logprobs == 3
    assert plan_of(decoder_input_details=True).output.prompt_logprobs == 0


def test_best_of_runs_as_n_choices_with_logprobs() -> None:
    plan = plan_of(best_of=2, do_sample=True)
    assert plan.sampling.n == 2 and plan.output.logprobs == 0


def fitted(
    plan: translate.Plan, prompt_tokens: int, *, context: int = 512, default: int | None = None
) -> Budget:
    """What the engine's prompt budget decides for the planned request, once its prompt is
    tokenized (`default`: the model's limit)."""
    s = translate.to_generation_request(plan, request_id="r").sampling
    return fit(
        prompt_tokens, context, truncate=s.truncate_prompt_tokens, max_tokens=s.max_new_tokens,
        default_max_tokens=default, policy=s.budget,
    )


def test_adapter_id_becomes_the_model() -> None:
    request = translate.to_generation_request(plan_of(adapter_id="a1"), request_id="r")
    assert request.model == "a1" and request.protocol == "tgi"
    assert request.prompt == TextPrompt("Hello")  # tokenized after admission, not before


# ---- lengths ------------------------------------------------------------------------------------


def test_truncate_keeps_the_last_tokens() -> None:
    assert fitted(plan_of(truncate=2), 4).keep == 2  # the fake engine's test shows which


def test_max_new_tokens_defaults_to_the_rest_of_the_context() -> None:
    assert fitted(plan_of(), 3).max_tokens == 509


def test_inputs_plus_max_new_tokens_over_the_total_is_refused() -> None:
    with pytest.raises(InvalidRequest) as caught:
        fitted(plan_of(max_new_tokens=510), 3)
    assert caught.value.message == (
        "`inputs` tokens + `max_new_tokens` must be <= 512. Given: 3 `inputs` tokens and 510 "
        "`max_new_tokens`"
    )


def test_the_check_counts_at_most_tgis_1024_token_round() -> None:
    """validation.rs: input + min(max_new_tokens, 1024) must fit; the message names that."""
    with pytest.raises(InvalidRequest) as caught:
        fitted(plan_of(max_new_tokens=100_000), 3)
    assert caught.value.message == (
        "`inputs` tokens + `max_new_tokens` must be <= 512. Given: 3 `inputs` tokens and 1024 "
        "`max_new_tokens`"
    )
    assert caught.value.param == "parameters.max_new_tokens"


@pytest.mark.parametrize(("asked", "runs"), [(1000, 1000), (1025, 1025), (5000, 2045)])
def test_a_limit_that_passes_the_check_generates_at_most_to_the_full_context(
    asked: int, runs: int
) -> None:
    assert fitted(plan_of(max_new_tokens=asked), 3, context=2048).max_tokens == runs


def test_the_1024_round_is_refused_when_the_context_cannot_hold_it() -> None:
    with pytest.raises(InvalidRequest, match=r"Given: 1100 `inputs` tokens and 1024 `max_new"):
        fitted(plan_of(max_new_tokens=5000), 1100, context=2048)


def test_inputs_longer_than_the_input_limit_are_refused() -> None:
    expected = r"`inputs` must have less than 511 tokens\. Given: 512"
    with pytest.raises(InvalidRequest, match=expected):
        fitted(plan_of(), 512)


# ---- responses ----------------------------------------------------------------------------------


def lp(token_id: int, text: str, logprob: float, *top: tuple[int, str, float]) -> TokenLogprob:
    alternatives = tuple(TopLogprob(token_id=i, token=t, logprob=v) for i, t, v in top)
    return TokenLogprob(token_id=token_id, token=text, logprob=logprob, top=alternatives)


def result(
    *choices: Choice, prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
) -> GenerationResult:
    return GenerationResult(
        request_id="r",
        model="",
        choices=choices,
        prompts=(Started(prompt_token_ids=(1, 9), prompt_logprobs=prompt_logprobs),),
        usage=Usage(prompt_tokens=2, completion_tokens=2),
    )


CHOICE = Choice(
    index=0,
    text=" a b",
    finish_reason=FinishReason.STOP,
    token_ids=(10, 11, EOS),
    logprobs=(lp(10, " a", -0.5, (10, " a", -0.5)), lp(11, " b", -0.25), lp(EOS, "</s>", -0.1)),
)


def rendering(plan: translate.Plan, texts: tuple[str, ...] = ()) -> translate.Rendering:
    return translate.Rendering(plan=plan, eos_token_id=EOS, prefill_texts=texts)


def test_plain_generate_response_has_only_the_text() -> None:
    out = translate.to_generate_response(result(CHOICE), rendering(plan_of()))
    assert out == {"generated_text": " a b"}


def test_return_full_text_prepends_the_inputs() -> None:
    out = translate.to_generate_response(result(CHOICE), rendering(plan_of(return_full_text=True)))
    assert out["generated_text"] == "Hello a b"


@pytest.mark.parametrize(
    ("given", "full_text", "expected"),
    [
        ({}, False, " a b"),  # /generate*: TGI's default is false
        ({}, True, "Hello a b"),  # POST /: the text-generation pipeline's default
        ({"return_full_text": False}, True, " a b"),
        ({"return_full_text": None}, True, "Hello a b"),  # clients send every key, null ones too
        ({"return_full_text": True}, False, "Hello a b"),
    ],
)
def test_an_omitted_return_full_text_takes_the_routes_default(
    given: dict[str, Any], full_text: bool, expected: str
) -> None:
    plan = translate.plan(body(**given), LIMITS, stream=False, full_text=full_text)
    assert translate.to_generate_response(result(CHOICE), rendering(plan)) == {
        "generated_text": expected
    }


def test_compat_default_holds_without_a_parameters_object() -> None:
    bare = GenerateRequest.model_validate({"inputs": "Hello"})
    assert translate.plan(bare, LIMITS, stream=False, full_text=True).full_text


def test_details_list_every_token_with_logprob_and_special_flag() -> None:
    out = translate.to_generate_response(result(CHOICE), rendering(plan_of(details=True)))
    assert out["details"] == {
        "finish_reason": "eos_token",
        "generated_tokens": 3,
        "seed": None,
        "prefill": [],
        "tokens": [
            {"id": 10, "text": " a", "logprob": -0.5, "special": False},
            {"id": 11, "text": " b", "logprob": -0.25, "special": False},
            {"id": EOS, "text": "</s>", "logprob": -0.1, "special": True},
        ],
    }


def test_decoder_input_details_add_the_prefill_with_a_null_first_logprob() -> None:
    res = result(CHOICE, prompt_logprobs=(None, lp(9, "x", -3.0)))
    out = translate.to_generate_response(
        res, rendering(plan_of(decoder_input_details=True), ("<s>", "x"))
    )
    assert out["details"]["prefill"] == [
        {"id": 1, "text": "<s>", "logprob": None},
        {"id": 9, "text": "x", "logprob": -3.0},
    ]


def test_top_n_tokens_fill_top_tokens() -> None:
    out = translate.to_generate_response(
        result(CHOICE), rendering(plan_of(details=True, top_n_tokens=1))
    )
    assert out["details"]["top_tokens"][0] == [
        {"id": 10, "text": " a", "logprob": -0.5, "special": False}
    ]


def test_best_of_returns_the_highest_mean_logprob_and_the_others() -> None:
    worse = Choice(
        index=1,
        text=" z",
        finish_reason=FinishReason.LENGTH,
        token_ids=(30,),
        logprobs=(lp(30, " z", -4.0),),
    )
    out = translate.to_generate_response(
        result(worse, CHOICE), rendering(plan_of(best_of=2, do_sample=True, details=True))
    )
    assert out["generated_text"] == " a b"
    assert [s["generated_text"] for s in out["details"]["best_of_sequences"]] == [" z"]
    assert out["details"]["best_of_sequences"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("reason", "matched", "expected"),
    [
        (FinishReason.LENGTH, None, "length"),
        (FinishReason.STOP, None, "eos_token"),
        (FinishReason.STOP, 7, "eos_token"),
        (FinishReason.STOP, "\n", "stop_sequence"),
        (FinishReason.ABORT, None, "stop_sequence"),
    ],
)
def test_finish_reasons(reason: FinishReason, matched: str | int | None, expected: str) -> None:
    assert translate.finish_reason(reason, matched) == expected


# ---- stream events ------------------------------------------------------------------------------


def texts(token_ids: list[int]) -> list[str]:
    """A tokenizer for the stream tests: token id i reads "<i>"."""
    return [f"<{i}>" for i in token_ids]


def test_stream_events_end_with_the_generated_text_and_details() -> None:
    encoder = translate.StreamEncoder(
        rendering(plan_of(True, details=True, seed=4)), input_length=2, token_texts=texts
    )
    first = encoder.events(Delta(choice=0, text=" a", token_ids=(10,)))
    last = encoder.events(Delta(choice=0, text=" b", token_ids=(11,), finish=FinishReason.LENGTH))
    assert first == [
        {
            "index": 1,
            "token": {"id": 10, "text": " a", "logprob": None, "special": False},
            "generated_text": None,
            "details": None,
        }
    ]
    assert last[0]["generated_text"] == " a b"
    assert last[0]["details"] == {
        "finish_reason": "length",
        "generated_tokens": 2,
        "seed": 4,
        "input_length": 2,
    }


def test_stream_details_are_null_without_details() -> None:
    encoder = translate.StreamEncoder(rendering(plan_of(True)), input_length=2, token_texts=texts)
    last = encoder.events(Delta(choice=0, text="x", token_ids=(5,), finish=FinishReason.STOP))
    assert last[0]["generated_text"] == "x" and last[0]["details"] is None


def test_a_merged_delta_gives_one_event_per_token_and_keeps_the_text_whole() -> None:
    encoder = translate.StreamEncoder(rendering(plan_of(True)), input_length=2, token_texts=texts)
    events = encoder.events(Delta(choice=0, text="héllo", token_ids=(5, 6, 7)))
    assert [e["token"]["id"] for e in events] == [5, 6, 7]
    assert [e["token"]["text"] for e in events] == ["", "", "héllo"]
    assert [e["index"] for e in events] == [1, 2, 3]


def test_a_merged_delta_gives_each_token_its_own_text_when_they_join_up() -> None:
    encoder = translate.StreamEncoder(rendering(plan_of(True)), input_length=2, token_texts=texts)
    events = encoder.events(Delta(choice=0, text="<5><6>", token_ids=(5, 6)))
    assert [e["token"]["text"] for e in events] == ["<5>", "<6>"]


def test_a_merged_delta_prefers_the_logprob_texts() -> None:
    encoder = translate.StreamEncoder(rendering(plan_of(True)), input_length=2, token_texts=texts)
    delta = Delta(
        choice=0, text=" a b", token_ids=(10, 11), logprobs=(lp(10, " a", -1.0), lp(11, " b", -2.0))
    )
    events = encoder.events(delta)
    assert [(e["token"]["text"], e["token"]["logprob"]) for e in events] == [
        (" a", -1.0),
        (" b", -2.0),
    ]


def test_an_end_without_a_token_closes_the_stream_with_a_special_token() -> None:
    encoder = translate.StreamEncoder(
        rendering(plan_of(True, details=True)), input_length=2, token_texts=texts
    )
    encoder.events(Delta(choice=0, text="x", token_ids=(5,)))
    final = encoder.events(
        Delta(choice=0, text="", finish=FinishReason.STOP, matched_stop="y")
    )[0]
    assert final["token"]["special"] is True and final["generated_text"] == "x"
    assert final["details"]["finish_reason"] == "stop_sequence"
    assert final["details"]["generated_tokens"] == 1


def test_top_n_tokens_appear_in_stream_events() -> None:
    encoder = translate.StreamEncoder(
        rendering(plan_of(True, top_n_tokens=1)), input_length=2, token_texts=texts
    )
    events = encoder.events(
        Delta(
            choice=0, text=" a", token_ids=(10,), logprobs=(lp(10, " a", -0.5, (10, " a", -0.5)),)
        ),
    )
    assert events[0]["token"]["logprob"] == -0.5
    assert events[0]["top_tokens"] == [{"id": 10, "text": " a", "logprob": -0.5, "special": False}]


# ---- tokenize and info --------------------------------------------------------------------------


def test_tokenize_offsets_are_byte_spans_of_the_input() -> None:
    out = translate.to_tokenize_response("Hi there", [1, 20, 21], ["<s>", "Hi", " there"])
    assert out == [
        {"id": 1, "text": "", "start": 0, "stop": 0},
        {"id": 20, "text": "Hi", "start": 0, "stop": 2},
        {"id": 21, "text": " there", "start": 2, "stop": 8},
    ]


def test_tokenize_pieces_of_a_multibyte_character_cover_it() -> None:
    out = translate.to_tokenize_response("é x", [40, 41, 42], ["\ufffd", "\ufffd", " x"])
    assert [(t["text"], t["start"], t["stop"]) for t in out] == [
        ("é", 0, 2),
        ("é", 0, 2),
        (" x", 2, 4),
    ]


def test_info_reports_tgi_fields_and_mindie_extras() -> None:
    info = EngineInfo(
        model_name="tiny",
        model_path="/m",
        max_model_len=512,
        vocab_size=903,
        dtype="float32",
        version="0.32.0",
        max_lora_rank=8,
        max_loras=2,
        max_cpu_loras=4,
        max_num_seqs=32,
        block_size=16,
        eos_token_id=EOS,
    )
    facts = translate.ServerFacts(
        served_name="tiny",
        version="0.1.0",
        max_concurrent_requests=64,
        max_client_batch_size=8,
        kv_cache_tokens=4096,
    )
    out = translate.to_info(info, LIMITS, facts)
    assert out["model_id"] == "tiny" and out["max_total_tokens"] == 512
    assert out["max_input_tokens"] == 511 and out["max_best_of"] == 2
    assert out["max_batch_total_tokens"] == 4096 and out["models"][0]["model_dtype"] == "float32"
    assert {"model_sha", "router", "version", "sha", "docker_label", "validation_workers"} <= set(
        out
    )


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "status", "error_type"),
    [
        (InvalidRequest("bad"), 422, "validation"),
        (Unsupported("no"), 422, "validation"),
        (AdapterNotFound("adapter_id `x` is not a loaded adapter"), 422, "validation"),
        (PayloadTooLarge("big"), 413, "validation"),
        (Overloaded(), 429, "overloaded"),
        (EngineError("boom"), 424, "generation"),
        (ServiceUnavailable("draining"), 503, "unhealthy"),
    ],
)
def test_error_table(exc: GatewayError, status: int, error_type: str) -> None:
    response = errors.render(exc)
    assert response.status_code == status
    assert jsonio.loads(bytes(response.body))["error_type"] == error_type


def test_validation_messages_get_tgi_prefix_once() -> None:
    _, body = errors.classify(InvalidRequest("`top_k` must be strictly positive"))
    assert body["error"] == "Input validation error: `top_k` must be strictly positive"
    _, again = errors.classify(InvalidRequest(body["error"]))
    assert again["error"] == body["error"]


def test_overloaded_carries_retry_after() -> None:
    assert errors.render(Overloaded(retry_after_s=3)).headers["retry-after"] == "3"


def test_stream_error_is_one_sse_event() -> None:
    frame = errors.stream_error(EngineError("boom"))
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert jsonio.loads(frame[6:]) == {
        "error": "Request failed during generation: boom",
        "error_type": "generation",
    }


@pytest.mark.parametrize("text", ["x", 'say "hi"', "é€😀", "\x00\n"])
@pytest.mark.parametrize("token_id", [5, EOS])
def test_plain_stream_event_is_byte_for_byte_the_general_event(text: str, token_id: int) -> None:
    plain = translate.StreamEncoder(rendering(plan_of(True)), input_length=2, token_texts=texts)
    general = translate.StreamEncoder(rendering(plan_of(True)), input_length=2, token_texts=texts)
    for _ in range(2):  # the index moves the same way on both
        delta = Delta(choice=0, text=text, token_ids=(token_id,))
        assert plain.plain_frame(delta, b"", b"") == jsonio.dumps(general.events(delta)[0])
    ended = Delta(choice=0, text=text, token_ids=(token_id,), finish=FinishReason.LENGTH)
    assert plain.plain_frame(ended, b"", b"") is None


@pytest.mark.parametrize("logprob", [-0.25, 0.0, -1e-9, -123.456, float("-inf")])
@pytest.mark.parametrize("text", ["x", 'say "hi"', "é€😀"])
def test_plain_stream_event_with_its_tokens_logprob_is_the_general_event(
    logprob: float, text: str
) -> None:
    """TGI always reports the sampled token's logprob: the template takes it too."""
    plain = translate.StreamEncoder(rendering(plan_of(True)), input_length=2, token_texts=texts)
    general = translate.StreamEncoder(rendering(plan_of(True)), input_length=2, token_texts=texts)
    entry = (TokenLogprob(token_id=5, token=text, logprob=logprob),)
    for token_id in (5, EOS):
        delta = Delta(choice=0, text=text, token_ids=(token_id,), logprobs=entry)
        expected = jsonio.dumps(general.events(delta)[0])
        assert plain.plain_frame(delta, b"data: ", b"\n\n") == b"data: " + expected + b"\n\n"


def test_plain_stream_event_leaves_top_tokens_to_the_general_event() -> None:
    encoder = translate.StreamEncoder(
        rendering(plan_of(True, top_n_tokens=2)), input_length=2, token_texts=texts
    )
    top = (TopLogprob(token_id=5, token="x", logprob=-0.1),)
    entry = (TokenLogprob(token_id=5, token="x", logprob=-0.1, top=top),)
    assert encoder.plain_frame(
        Delta(choice=0, text="x", token_ids=(5,), logprobs=entry), b"", b"") is None
