"""MindIE native translation and error table, without a server: `/infer` prompts and bounds,
stream events with prefill/decode times, the vLLM flavour of `/generate`, `/v1/tokenizer`."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocols.mindie import errors, translate
from protocols.mindie.schema import InferRequest, VllmGenerateRequest
from server.core.errors import (
    AdapterNotFound,
    EngineError,
    GatewayError,
    InvalidRequest,
    Overloaded,
    RequestNotFound,
    ServiceUnavailable,
    Unsupported,
)
from server.core.types import (
    Choice,
    Delta,
    FinishReason,
    GenerationResult,
    OutputOptions,
    SamplingDefaults,
    Started,
    TextPrompt,
    TokenPrompt,
    Usage,
)
from server.http import jsonio
from server.http.context import RequestBounds

DEFAULTS = SamplingDefaults(
    temperature=0.7, top_p=0.9, top_k=40, min_p=0.1, repetition_penalty=1.05,
    presence_penalty=0.5, frequency_penalty=0.2, max_new_tokens=64,
)


def infer_plan(
    stream: bool = False, defaults: SamplingDefaults | None = None, **parameters: Any
) -> translate.InferPlan:
    body = InferRequest.model_validate({"stream": stream, "parameters": parameters})
    return translate.infer_request(
        body, TextPrompt("hi"), request_id="r1", defaults=defaults or SamplingDefaults()
    )


def infer_rejection(**parameters: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        infer_plan(**parameters)
    return caught.value


# ---- /infer prompts ------------------------------------------------------------------------------


def test_inputs_become_a_text_prompt_and_input_id_a_token_prompt() -> None:
    assert translate.infer_prompt({"inputs": "Hello"}) == TextPrompt("Hello")
    assert translate.infer_prompt({"input_id": [1, 2, 3]}) == TokenPrompt((1, 2, 3))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"inputs": "a", "input_id": [1]}, "Input conflict."),
        ({}, "Not found inputs."),
        ({"inputs": None}, "Inputs must not be null"),
        ({"inputs": 5}, "The type of inputs is abnormal"),
        ({"inputs": ""}, "Inputs must be necessary and data type must be string"),
        ({"inputs": []}, "Inputs arr is empty"),
        ({"input_id": None}, "Input_id should not be empty"),
        ({"input_id": "1 2"}, "Parameter input_id must be an array"),
        ({"input_id": [1, "2"]}, "Parameter input_id must be integer"),
        ({"input_id": [1, True]}, "Parameter input_id must be integer"),
        ({"input_id": [-1]}, "Data element in param input_id is invalid"),
        ({"input_id": [2_000_000]}, "Data element in param input_id is invalid"),
        ({"input_id": []}, "Inputs token length must be in (0, 1048576], but got 0"),
    ],
)
def test_bad_prompts_get_mindie_messages(body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        translate.infer_prompt(body)
    assert caught.value.message.startswith(message)


def test_multimodal_text_items_are_joined() -> None:
    prompt = translate.infer_prompt({"inputs": [{"type": "text", "text": "a"}, {"text": "b"}]})
    assert prompt == TextPrompt("ab")


def test_multimodal_media_is_unsupported() -> None:
    with pytest.raises(Unsupported):
        translate.infer_prompt({"inputs": [{"type": "image_url", "image_url": "/x.png"}]})


# ---- /infer parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"temperature": 0}, "Parameter temperature must be in (0.0,"),
        ({"top_k": 0}, "Parameter top_k must be in"),
        ({"top_p": 1.0}, "Parameter top_p must be in (0.0,1.0], got 1.0."),  # MindIE's words
        ({"typical_p": 0}, "Parameter typical_p must be in (0.0,1.0]"),
        ({"repetition_penalty": 0}, "Parameter 'repetition_penalty' must be in (0.0,"),
        ({"priority": 6}, "Parameter priority must be in [1,5], got 6."),
        ({"max_new_tokens": 0}, "Parameter max_new_tokens must be in (0,2147483647], got 0."),
        ({"timeout": 70000}, "Parameter timeout must be strictly positive"),
        ({"seed": 2**63}, "Parameter seed must be in [0, 9223372036854775807]"),
    ],
)
def test_out_of_range_parameters_get_mindie_messages(
    parameters: dict[str, Any], message: str
) -> None:
    assert infer_rejection(**parameters).message.startswith(message)


# Keys `SingleReqSelfDevelopInferInterface::SetupInferParams` does not read: MindIE ignores them.
INFER_IGNORED = [
    {"stop": [""]},
    {"stop_token_ids": [10**9]},
    {"truncate": 0},
    {"top_n_tokens": 1000},
    {"decoder_input_details": True},
]


@pytest.mark.parametrize("ignored", INFER_IGNORED)
def test_infer_ignores_what_mindie_does_not_read(ignored: dict[str, Any]) -> None:
    baseline = infer_plan(max_new_tokens=3, details=True)
    assert infer_plan(max_new_tokens=3, details=True, **ignored) == baseline
    top_level = InferRequest.model_validate({"parameters": {"max_new_tokens": 3}, **ignored})
    plan = translate.infer_request(top_level, TextPrompt("hi"), request_id="r1")
    assert plan == infer_plan(max_new_tokens=3)
    assert plan.request.output == OutputOptions()


def test_watermark_is_reported_unsupported() -> None:
    with pytest.raises(Unsupported):
        infer_plan(watermark=True)


def test_infer_defaults_to_twenty_greedy_tokens() -> None:
    request = infer_plan().request
    assert request.sampling.max_new_tokens == 20 and request.sampling.temperature == 0.0
    assert request.request_id == "r1" and request.model == "" and request.protocol == "mindie"


def test_sampling_knobs_turn_sampling_on_unless_do_sample_is_false() -> None:
    assert infer_plan(temperature=0.7).request.sampling.temperature == 0.7
    assert infer_plan(temperature=0.7, do_sample=False).request.sampling.temperature == 0.0
    assert infer_plan(do_sample=True).request.sampling.temperature == 1.0


def test_infer_takes_the_model_defaults_for_what_it_leaves_out() -> None:
    s = infer_plan(defaults=DEFAULTS, do_sample=True).request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (0.7, 0.9, 40, 1.05)
    assert s.max_new_tokens is None  # the model's limit, applied by the engine in the room
    # MindIE's /infer has no min_p or presence/frequency penalties: the model's are not applied
    assert (s.min_p, s.presence_penalty, s.frequency_penalty) == (0.0, 0.0, 0.0)
    s = infer_plan(defaults=DEFAULTS, top_k=5).request.sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.7, 0.9, 5)


def test_infer_greedy_stays_greedy_with_the_model_penalty_and_limit() -> None:
    for parameters in ({}, {"do_sample": False, "temperature": 0.5}):
        s = infer_plan(defaults=DEFAULTS, **parameters).request.sampling
        assert (s.temperature, s.top_p, s.top_k) == (0.0, 1.0, 0)
        assert s.repetition_penalty == 1.05 and s.max_new_tokens is None


def test_infer_values_given_win_over_the_model_defaults() -> None:
    s = infer_plan(defaults=DEFAULTS, temperature=0.2, top_p=0.5, top_k=3,
                   repetition_penalty=1.3, max_new_tokens=7).request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.max_new_tokens) == (
        0.2, 0.5, 3, 1.3, 7
    )


def test_timeout_becomes_the_request_deadline() -> None:
    assert infer_plan(timeout=30).request.timeout_s == 30


def test_request_id_must_match_mindie_pattern() -> None:
    with pytest.raises(Exception, match="String should match pattern"):
        InferRequest.model_validate({"id": "bad id!"})
    assert InferRequest.model_validate({"id": "ok_id-1"}).id == "ok_id-1"


# ---- /infer responses ----------------------------------------------------------------------------


def result(*choices: Choice) -> GenerationResult:
    return GenerationResult(
        request_id="r",
        model="",
        prompts=(Started(prompt_token_ids=(1, 9)),),
        choices=choices,
        usage=Usage(prompt_tokens=2, completion_tokens=3),
    )


CHOICE = Choice(index=0, text=" a b", finish_reason=FinishReason.LENGTH, token_ids=(10, 11, 12))


def test_infer_response_without_details_is_only_the_text() -> None:
    assert translate.to_infer_response(result(CHOICE), infer_plan()) == {"generated_text": " a b"}


def test_infer_response_details_list_the_generated_ids() -> None:
    out = translate.to_infer_response(result(CHOICE), infer_plan(details=True, seed=7))
    assert out["details"] == {
        "finish_reason": "length",
        "generated_tokens": 3,
        "generated_token_ids": [10, 11, 12],
        "seed": 7,
    }


def texts(token_ids: list[int]) -> list[str]:
    return [f"<{i}>" for i in token_ids]


def test_infer_stream_first_event_has_prefill_time_then_decode_times() -> None:
    encoder = translate.InferStreamEncoder(
        infer_plan(True, details=True), started_at=0.0, token_texts=texts
    )
    first = encoder.events(Delta(choice=0, text=" a", token_ids=(10,)), 0.050)
    second = encoder.events(Delta(choice=0, text=" b", token_ids=(11,)), 0.060)
    last = encoder.events(
        Delta(choice=0, text=" c", token_ids=(12,), finish=FinishReason.STOP), 0.075
    )
    assert first == [{"prefill_time": 50.0, "decode_time": None, "token": {"id": 10, "text": " a"}}]
    assert second[0]["prefill_time"] is None and second[0]["decode_time"] == pytest.approx(10.0)
    assert list(last[0]) == ["prefill_time", "decode_time", "generated_text", "details", "token"]
    assert last[0]["generated_text"] == " a b c"
    assert last[0]["token"] == {"id": 12, "text": None}
    assert last[0]["details"] == {"finish_reason": "eos_token", "generated_tokens": 3, "seed": None}


def test_infer_stream_details_are_null_without_details() -> None:
    encoder = translate.InferStreamEncoder(infer_plan(True), started_at=0.0, token_texts=texts)
    last = encoder.events(
        Delta(choice=0, text="x", token_ids=(5,), finish=FinishReason.LENGTH), 0.01
    )
    assert last[0]["details"] is None and last[0]["generated_text"] == "x"


def test_infer_stream_end_without_a_token_repeats_the_last_id() -> None:
    encoder = translate.InferStreamEncoder(
        infer_plan(True, details=True), started_at=0.0, token_texts=texts
    )
    encoder.events(Delta(choice=0, text="x", token_ids=(5,)), 0.01)
    final = encoder.events(Delta(choice=0, text="", finish=FinishReason.ABORT), 0.02)[0]
    assert final["token"] == {"id": 5, "text": None}
    assert final["details"]["generated_tokens"] == 1
    assert final["details"]["finish_reason"] == "stop_sequence"


# ---- /generate, vLLM flavour ---------------------------------------------------------------------


VOCAB = 908
SAMPLED_ONLY = "Best_of/N can not greater than 1 when temperature is 0 or not set, but"
STOP_LIST = (
    "Input validation error: `stop` must be list[string] if list, and item length in [1, 1024] "
    "with total <= 32768"
)


def vllm_plan(defaults: SamplingDefaults | None = None, **body: Any) -> translate.VllmPlan:
    return translate.vllm_request(
        VllmGenerateRequest.model_validate({"prompt": "Hello", **body}),
        request_id="r",
        bounds=RequestBounds(),
        vocab_size=VOCAB,
        defaults=defaults or SamplingDefaults(),
    )


def test_vllm_flavour_reads_sampling_fields_at_the_top_level() -> None:
    plan = vllm_plan(max_tokens=5, temperature=0.5, top_k=-1, top_p=1.0, n=2, stop="x", model="a1")
    s = plan.request.sampling
    assert (s.max_new_tokens, s.temperature, s.top_k, s.top_p, s.n, s.stop) == (
        5,
        0.5,
        0,
        1.0,
        2,
        ("x",),
    )
    assert plan.request.model == "a1" and plan.prompt_text == "Hello"


def test_vllm_flavour_defaults_to_sixteen_tokens() -> None:
    assert vllm_plan().request.sampling.max_new_tokens == 16


def test_vllm_flavour_takes_the_model_defaults_for_what_it_leaves_out() -> None:
    s = vllm_plan(DEFAULTS).request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (0.7, 0.9, 40, 1.05)
    assert (s.presence_penalty, s.frequency_penalty, s.min_p) == (0.5, 0.2, 0.0)
    assert s.max_new_tokens is None
    given = {"temperature": 0, "top_k": -1, "max_tokens": 3, "frequency_penalty": 0.0}
    s = vllm_plan(DEFAULTS, **given).request.sampling
    assert (s.temperature, s.top_k, s.max_new_tokens, s.frequency_penalty) == (0, 0, 3, 0.0)
    assert s.top_p == 0.9  # an explicit temperature 0 is greedy anyway; omitted fields default


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 0}, "Parameter max_tokens must be (0,"),
        ({"n": 0}, "Parameter [n] should be in [1, 16], got 0."),
        ({"temperature": -1}, "Parameter temperature must be in (0.0,3.40282e+38], got -1"),
        ({"top_k": -2}, "Parameter top_k must be in -1 || (0,2147483647], got -2"),
        ({"top_p": 0}, "Parameter top_p must be in (0.0,1.0]"),
        ({"presence_penalty": 3}, "Parameter presence_penalty not in [-2.0, 2.0], but got 3"),
        ({"frequency_penalty": -3}, "Parameter frequency_penalty should be in [-2.0, 2.0], got -3"),
        ({"stop": [""]}, STOP_LIST),
        ({"stop": ["x" * 1025]}, STOP_LIST),
        ({"stop": ""}, "Input validation error: length of `stop` must be in [1, 1024], but got 0"),
        ({"stop": ["x"] * 17}, "Input validation error: `stop` supports up to 16 stop sequences"),
        ({"best_of": 1, "n": 2}, "best_of should greater than or equal to n, but best_of is 1"),
        ({"best_of": 0}, "Parameter [best_of] should be in [1, 16], got 0."),
        ({"n": 2}, f"{SAMPLED_ONLY} best_of is None, n is 2."),
        ({"n": 2, "best_of": 2, "temperature": 0}, f"{SAMPLED_ONLY} best_of is 2, n is 2."),
    ],
)
def test_vllm_flavour_bounds(body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        vllm_plan(**body)
    assert caught.value.message.startswith(message)


# Keys `SingleReqVllmInferInterface::SetupInferParams` does not read: MindIE ignores them, so
# none reaches the engine (prompt logprobs with LoRA would kill the CPU engine).
VLLM_IGNORED = [
    {"prompt_logprobs": 1},
    {"logprobs": 1000},
    {"logit_bias": {"5": 100}},
    {"allowed_token_ids": [10**9]},
    {"min_tokens": 10, "max_tokens": 3},
    {"use_beam_search": True},
]


@pytest.mark.parametrize("ignored", VLLM_IGNORED)
def test_vllm_flavour_ignores_what_mindie_does_not_read(ignored: dict[str, Any]) -> None:
    plan = vllm_plan(model="a1", **{"max_tokens": 3, **ignored})
    assert plan == vllm_plan(model="a1", max_tokens=3)
    assert plan.request.output == OutputOptions()
    assert plan.request.sampling.min_new_tokens == 0
    assert (plan.request.sampling.logit_bias, plan.request.sampling.allowed_token_ids) == ((), None)


def test_vllm_flavour_stop_token_ids_keep_only_ids_that_can_stop() -> None:
    ids = [5, -1, 5, VOCAB - 1, VOCAB, 2**31 - 1, 2**40, 3]
    assert vllm_plan(stop_token_ids=ids).request.sampling.stop_token_ids == (3, 5, VOCAB - 1)
    assert vllm_plan(stop_token_ids=[10**9]).request.sampling.stop_token_ids == ()


def test_vllm_flavour_stop_strings_total_at_most_32k_as_mindie() -> None:
    body = VllmGenerateRequest.model_validate({"prompt": "Hello", "stop": ["x" * 1024] * 33})
    with pytest.raises(InvalidRequest) as caught:
        translate.vllm_request(
            body, request_id="r", bounds=RequestBounds(max_stop_sequences=64), vocab_size=VOCAB
        )
    assert caught.value.message == STOP_LIST


def test_vllm_flavour_best_of_above_n_is_unsupported() -> None:
    with pytest.raises(Unsupported):
        vllm_plan(best_of=2)


def test_vllm_response_joins_prompt_and_completion_with_a_space() -> None:
    two = (CHOICE, Choice(index=1, text=" z", finish_reason=FinishReason.STOP))
    out = translate.to_vllm_response(result(*two), vllm_plan())
    assert out == {"text": ["Hello  a b", "Hello  z"]}


def test_vllm_stream_chunk_fills_only_its_choice() -> None:
    assert translate.vllm_chunk(Delta(choice=1, text="x"), 3) == {"text": ["", "x", ""]}


def test_vllm_multimodal_prompt_echoes_its_first_text_item() -> None:
    plan = vllm_plan(prompt=[{"type": "text", "text": "Hi"}])
    assert plan.prompt_text == "Hi" and plan.request.prompt == TextPrompt("Hi")


# ---- /v1/tokenizer and errors ----------------------------------------------------------------


def test_tokenizer_response_counts_and_lists_tokens() -> None:
    assert translate.to_tokenizer_response([1, 2], ["<s>", "a"]) == {
        "token_number": 2,
        "tokens": ["<s>", "a"],
    }


@pytest.mark.parametrize(
    ("exc", "status", "reason"),
    [
        (InvalidRequest("bad"), 422, "Input Validation Error"),
        (Unsupported("no"), 422, "Input Validation Error"),
        (AdapterNotFound("gone"), 404, "NotFoundError"),
        (RequestNotFound("RequestId is x not found."), 404, "NotFoundError"),
        (Overloaded(), 429, "Too Many Requests"),
        (ServiceUnavailable("The service has been stopped."), 503, "Service Unavailable"),
        (EngineError("boom"), 500, "Incomplete Generation"),
    ],
)
def test_error_table(exc: GatewayError, status: int, reason: str) -> None:
    response = errors.render(exc)
    assert response.status_code == status
    assert jsonio.loads(bytes(response.body)) == {"error": exc.message, "error_type": reason}


def test_stream_errors_are_framed_per_route() -> None:
    assert errors.stream_error(EngineError("x")).startswith(b"data: {")
    chunk = errors.chunk_error(EngineError("x"))
    assert chunk.endswith(b"\0") and jsonio.loads(chunk[:-1])["error"] == "x"


@pytest.mark.parametrize("text", [" a", 'say "hi"', "é€😀"])
def test_plain_infer_event_is_byte_for_byte_the_general_event(text: str) -> None:
    plain = translate.InferStreamEncoder(infer_plan(True), started_at=0.0, token_texts=texts)
    general = translate.InferStreamEncoder(infer_plan(True), started_at=0.0, token_texts=texts)
    for now in (0.0123456, 0.0500001, 0.07):  # the first event has prefill_time, then decode
        delta = Delta(choice=0, text=text, token_ids=(10,))
        assert plain.plain_frame(delta, now, b"", b"") == jsonio.dumps(
            general.events(delta, now)[0])
    ended = Delta(choice=0, text=text, token_ids=(10,), finish=FinishReason.LENGTH)
    assert plain.plain_frame(ended, 0.08, b"", b"") is None


def test_stream_times_round_as_round_does() -> None:
    """The plain event writes `round(ms, 3)` from `.3f`'s digits (cheaper): the same bytes."""
    general = translate.InferStreamEncoder(infer_plan(True), started_at=0.0, token_texts=texts)
    plain = translate.InferStreamEncoder(infer_plan(True), started_at=0.0, token_texts=texts)
    delta = Delta(choice=0, text="a", token_ids=(10,))
    now = 0.0
    for step in (1e-7, 0.0000005, 0.0000015, 0.0012345, 0.0125, 0.0999995, 1.2344999, 3600.0):
        now += step
        assert plain.plain_frame(delta, now, b"", b"") == jsonio.dumps(
            general.events(delta, now)[0])
    # 1e9 ms and more: the general event
    assert plain.plain_frame(delta, now + 1e6, b"", b"") is None


@given(st.floats(min_value=0.0, max_value=999_999.0))
def test_any_stream_time_is_written_as_the_general_event_writes_it(seconds: float) -> None:
    general = translate.InferStreamEncoder(infer_plan(True), started_at=0.0, token_texts=texts)
    plain = translate.InferStreamEncoder(infer_plan(True), started_at=0.0, token_texts=texts)
    delta = Delta(choice=0, text="a", token_ids=(10,))
    for now in (seconds, 2 * seconds):  # prefill_time, then decode_time
        assert plain.plain_frame(delta, now, b"", b"") == jsonio.dumps(
            general.events(delta, now)[0])
