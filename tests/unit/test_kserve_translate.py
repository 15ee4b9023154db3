"""Triton / KServe v2 pure parts: tensor codec (JSON and binary), sampling knobs, translation,
response shapes, error table and statistics. No server, no engine."""

from __future__ import annotations

import gzip
import json
import struct
import zlib
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocols.kserve_v2 import errors, tensors
from protocols.kserve_v2.models import ModelRef, model_config, model_metadata, resolve_model
from protocols.kserve_v2.sampling import KNOWN, read_knobs, to_knobs
from protocols.kserve_v2.schema import InferRequest
from protocols.kserve_v2.stats import InferenceStats
from protocols.kserve_v2.tensors import DATATYPES, Tensor
from protocols.kserve_v2.translate import (
    OutputPlan,
    StreamFolder,
    Target,
    TextCall,
    TokenCall,
    decode_inputs,
    generate_body,
    generate_fields,
    infer_call,
    output_plan,
    response_header,
    select_outputs,
    stop_infer_id,
    text_call,
    text_outputs,
)
from server.core.errors import (
    AdapterNotFound,
    DeadlineExceeded,
    EngineError,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    RequestNotFound,
    ServiceUnavailable,
    Unsupported,
)
from server.core.types import (
    Choice,
    Delta,
    Done,
    FinishReason,
    GenerationResult,
    SamplingDefaults,
    Started,
    StructuredOutput,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
    TopLogprob,
    Usage,
)
from server.http import jsonio
from server.http.context import RequestBounds

BOUNDS = RequestBounds(max_n=4, max_stop_sequences=2, max_stop_length=8, max_logprobs=5)
BASE = ModelRef("tiny")


def target(model: ModelRef = BASE, client_id: str | None = None) -> Target:
    return Target(model=model, request_id=client_id or "rid", client_id=client_id, bounds=BOUNDS,
                  adapters=frozenset({"a1", "a2"}), vocab_size=100)


def tensor(name: str, datatype: str, *values: Any) -> Tensor:
    data = tuple(v.encode() if isinstance(v, str) else v for v in values)
    return Tensor(name, datatype, (len(values),), data)


def prompt_inputs(text: str = "hi", **flags: bool) -> dict[str, Tensor]:
    found = {"text_input": tensor("text_input", "BYTES", text)}
    found.update({name: tensor(name, "BOOL", value) for name, value in flags.items()})
    return found


def result(*texts: str, reason: FinishReason = FinishReason.LENGTH,
           logprobs: tuple[TokenLogprob, ...] = ()) -> GenerationResult:
    choices = tuple(
        Choice(index=i, text=t, finish_reason=reason, token_ids=tuple(range(len(t))),
               logprobs=logprobs)
        for i, t in enumerate(texts)
    )
    return GenerationResult(
        request_id="r", model="tiny", prompts=(Started(prompt_token_ids=(1, 2)),),
        choices=choices, usage=Usage(prompt_tokens=2, completion_tokens=3),
    )


# ---- binary tensor codec -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("datatype", "values"),
    [
        ("BOOL", (True, False, True)), ("UINT8", (0, 255)), ("UINT16", (1, 65535)),
        ("UINT32", (0, 4294967295)), ("UINT64", (2**64 - 1,)), ("INT8", (-128, 127)),
        ("INT16", (-2, 3)), ("INT32", (-(2**31), 7)), ("INT64", (-(2**63),)),
        ("FP16", (0.5, -2.0)), ("FP32", (1.25, -3.5)), ("FP64", (1e300,)), ("BF16", (1.5, -2.0)),
        ("BYTES", (b"", b"abc", "é".encode())),
    ],
)
def test_binary_round_trip_of_every_datatype(datatype: str, values: tuple[Any, ...]) -> None:
    original = Tensor("t", datatype, (len(values),), values)
    raw = tensors.to_binary(original)
    assert tensors.from_binary("t", DATATYPES[datatype], original.shape, raw) == original


def test_binary_layout_is_little_endian_with_length_prefixed_strings() -> None:
    assert tensors.to_binary(Tensor("t", "UINT32", (2,), (1, 256))) == b"\x01\0\0\0\0\x01\0\0"
    assert tensors.to_binary(Tensor("t", "BYTES", (2,), (b"ab", b""))) == (
        b"\x02\0\0\0ab\0\0\0\0"
    )
    assert tensors.to_binary(Tensor("t", "BOOL", (2,), (True, False))) == b"\x01\x00"


@given(st.lists(st.binary(max_size=40), max_size=8))
def test_bytes_elements_round_trip(items: list[bytes]) -> None:
    original = Tensor("t", "BYTES", (len(items),), tuple(items))
    raw = tensors.to_binary(original)
    assert tensors.from_binary("t", DATATYPES["BYTES"], original.shape, raw) == original


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=16))
def test_uint32_round_trip(ids: list[int]) -> None:
    original = Tensor("t", "UINT32", (1, len(ids)), tuple(ids))
    raw = tensors.to_binary(original)
    assert len(raw) == 4 * len(ids)
    assert tensors.from_binary("t", DATATYPES["UINT32"], original.shape, raw) == original


@pytest.mark.parametrize(
    ("datatype", "shape", "raw", "message"),
    [
        ("BYTES", (1,), b"\x05\0\0\0ab", "incomplete string data"),
        ("BYTES", (1,), b"\x05\0", "incomplete string length"),
        ("BYTES", (2,), b"\x01\0\0\0a", "unexpected number of string elements 1"),
        ("UINT32", (2,), b"\x01\0\0\0", "unexpected total byte size 4"),
        ("BOOL", (1,), b"", "unexpected total byte size 0"),
    ],
)
def test_malformed_binary_inputs_are_invalid(
    datatype: str, shape: tuple[int, ...], raw: bytes, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        tensors.from_binary("x", DATATYPES[datatype], shape, raw)


def test_split_body_by_the_inference_header_length() -> None:
    assert tensors.split_body(b'{"a":1}rest', "7") == (b'{"a":1}', b"rest")
    assert tensors.split_body(b'{"a":1}', None) == (b'{"a":1}', None)
    for bad, message in (("8", "should be in range"), ("-1", "Unable to parse"),
                         ("0", "raw binary"), ("abc", "Unable to parse")):
        with pytest.raises(InvalidRequest, match=message):
            tensors.split_body(b'{"a":1}', bad)


def test_encode_response_puts_binary_outputs_after_the_header_in_order() -> None:
    outputs = [tensor("a", "BYTES", "xy"), tensor("b", "UINT32", 7), tensor("c", "FP32", 0.5)]
    body, length = tensors.encode_response({"model_name": "m"}, outputs, frozenset({"a", "c"}))
    assert length is not None
    head = json.loads(body[:length])
    assert head["outputs"] == [
        {"name": "a", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6}},
        {"name": "b", "datatype": "UINT32", "shape": [1], "data": [7]},
        {"name": "c", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}},
    ]
    assert body[length:] == b"\x02\0\0\0xy" + struct.pack("<f", 0.5)


def test_encode_response_without_binary_is_plain_json() -> None:
    body, length = tensors.encode_response({"id": "1"}, [tensor("a", "BYTES", "é")], frozenset())
    assert length is None
    assert json.loads(body) == {"id": "1", "outputs": [
        {"name": "a", "datatype": "BYTES", "shape": [1], "data": ["é"]}]}


def test_tritonclient_decodes_our_binary_response() -> None:
    from tritonclient.http import InferResult

    outputs = [tensor("text_output", "BYTES", "héllo", "w"), tensor("n", "UINT32", 3, 4)]
    body, length = tensors.encode_response(
        {"model_name": "m", "model_version": "1"}, outputs, frozenset({"text_output", "n"})
    )
    parsed = InferResult.from_response_body(body, header_length=length)
    assert parsed.as_numpy("text_output").tolist() == ["héllo".encode(), b"w"]
    assert parsed.as_numpy("n").tolist() == [3, 4]


# ---- JSON tensor data ----------------------------------------------------------------------------
def test_json_data_may_be_nested_and_is_flattened_row_major() -> None:
    got = tensors.from_json("t", DATATYPES["INT32"], (2, 2), [[1, 2], [3, 4]])
    assert got.data == (1, 2, 3, 4)


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("BYTES", [1], "non-string as string"), ("BOOL", ["true"], "non-boolean as boolean"),
        ("UINT32", [-1], "out of range"), ("UINT8", [256], "out of range"),
        ("INT32", [1.5], "non-signed-integer"), ("UINT32", [True], "non-unsigned-integer"),
        ("FP32", ["x"], "non-number"), ("INT8", [1, 2], "expects 1 element"),
    ],
)
def test_json_data_type_errors(datatype: str, data: list[Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        tensors.from_json("t", DATATYPES[datatype], (1,), data)


def test_decode_inputs_mixes_json_and_binary_in_input_order() -> None:
    wire = InferRequest.model_validate({"inputs": [
        {"name": "a", "shape": [1], "datatype": "BOOL", "parameters": {"binary_data_size": 1}},
        {"name": "b", "shape": [1], "datatype": "BYTES", "data": ["j"]},
        {"name": "c", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 5}},
    ]})
    got = decode_inputs(wire.inputs, b"\x01\x01\0\0\0z", "m")
    assert [t.data for t in got] == [(True,), (b"j",), (b"z",)]
    with pytest.raises(InvalidRequest, match="Infer-Header-Content-Length"):
        decode_inputs(wire.inputs, None, "m")


def test_decode_inputs_refuses_data_and_binary_together_and_shared_memory() -> None:
    both = InferRequest.model_validate({"inputs": [
        {"name": "a", "shape": [1], "datatype": "BOOL", "data": [True],
         "parameters": {"binary_data_size": 1}}]})
    with pytest.raises(InvalidRequest, match="set 'data' 'binary_data_size'"):
        decode_inputs(both.inputs, b"\x01", "m")
    shm = InferRequest.model_validate({"inputs": [
        {"name": "a", "shape": [1], "datatype": "BOOL",
         "parameters": {"shared_memory_region": "r"}}]})
    with pytest.raises(Unsupported):
        decode_inputs(shm.inputs, None, "m")


def test_inflate_gzip_and_deflate_with_a_size_limit() -> None:
    assert tensors.inflate(gzip.compress(b"abc"), "gzip", 10) == b"abc"
    assert tensors.inflate(zlib.compress(b"abc"), "deflate", 10) == b"abc"
    assert tensors.inflate(b"abc", None, 10) == b"abc"
    with pytest.raises(PayloadTooLarge):
        tensors.inflate(gzip.compress(b"a" * 1000), "gzip", 100)
    with pytest.raises(InvalidRequest, match="not valid gzip"):
        tensors.inflate(b"plain", "gzip", 100)
    with pytest.raises(InvalidRequest, match="Unsupported content-encoding"):
        tensors.inflate(b"x", "br", 100)


# ---- sampling knobs ------------------------------------------------------------------------------
def test_vllm_and_mindie_names_map_to_the_same_knobs() -> None:
    vllm_names = {"max_tokens": "7", "temperature": 0, "top_k": 5, "ignore_eos": "true",
                  "stop": "x"}
    mindie_names = {"max_new_tokens": 7, "do_sample": False, "top_k": 5, "ignore_eos": True,
                    "stop": ["x"]}
    vllm = to_knobs(read_knobs(vllm_names, from_request=False), BOUNDS, 16)
    mindie = to_knobs(read_knobs(mindie_names, from_request=True), BOUNDS, 16)
    assert vllm.sampling == mindie.sampling
    assert vllm.sampling.max_new_tokens == 7 and vllm.sampling.temperature == 0.0


def test_unknown_knobs_are_errors_in_the_tensor_and_in_request_parameters() -> None:
    for from_request in (False, True):
        with pytest.raises(InvalidRequest) as caught:
            read_knobs({"bogus": 1}, from_request=from_request)
        assert caught.value.message == (
            "Error generating stream: Unexpected keyword argument 'bogus' (sampling parameters "
            "are vLLM SamplingParams fields and lora_name)"
        )
        assert errors.render(caught.value).status_code == 400


def test_request_parameters_may_carry_tritons_own_keys_and_input_flags() -> None:
    owned = {"sequence_id": 3, "sequence_start": True, "binary_data_output": True,
             "headers": "x", "triton_enable_empty_final_response": True, "stream": False,
             "exclude_input_in_output": True, "return_finish_reason": True}
    assert read_knobs(owned, from_request=True) == {}
    with pytest.raises(InvalidRequest, match="Unexpected keyword argument 'sequence_id'"):
        read_knobs({"sequence_id": 3}, from_request=False)


def test_sampling_parameters_among_the_request_parameters_is_refused_not_skipped() -> None:
    with pytest.raises(InvalidRequest, match="Unexpected keyword argument 'sampling_parameters'"):
        read_knobs({"sampling_parameters": '{"max_tokens": 3}'}, from_request=True)


# vLLM 0.32's SamplingParams fields (spec §4); the integration tier checks the installed vLLM.
VLLM_032_FIELDS = frozenset({
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
    "watermarking", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "prompt_logprob_token_ids",
    "prompt_logprob_start", "logprob_token_ids", "flat_logprobs", "detokenize",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "output_kind", "stream_interval", "skip_clone", "output_text_buffer_length",
    "structured_outputs", "logit_bias", "allowed_token_ids", "extra_args", "bad_words",
    "skip_reading_prefix_cache", "thinking_token_budget", "repetition_detection",
    "routed_experts_prompt_start", "trace_decode_token_ids",
})


def test_every_sampling_params_field_and_lora_name_is_known() -> None:
    assert VLLM_032_FIELDS | {"lora_name"} <= KNOWN


def test_fields_the_engine_cannot_carry_are_accepted_only_at_their_default() -> None:
    at_default = {"prompt_logprobs": None, "detokenize": True, "flat_logprobs": "false",
                  "skip_clone": False, "output_text_buffer_length": 0,
                  "routed_experts_prompt_start": "0", "extra_args": None}
    assert read_knobs(at_default, from_request=False) == {}
    for name, value in (("prompt_logprobs", 2), ("detokenize", False), ("extra_args", {"a": 1}),
                        ("watermarking", True), ("output_text_buffer_length", 3),
                        ("thinking_token_budget", 10)):
        with pytest.raises(Unsupported) as caught:
            read_knobs({name: value}, from_request=False)
        assert caught.value.message.startswith(
            f"sampling parameter '{name}' is not supported by this server (only its default"
        )


def test_token_lists_words_and_logit_bias_reach_the_sampling() -> None:
    knobs = to_knobs(read_knobs({"allowed_token_ids": [3, 4], "bad_words": ["x y"],
                                 "logit_bias": {"5": -2.5, "7": 1}}, from_request=False),
                     BOUNDS, 16)
    s = knobs.sampling
    assert s.allowed_token_ids == (3, 4) and s.bad_words == ("x y",)
    assert s.logit_bias == ((5, -2.5), (7, 1.0))
    for params, message in (({"allowed_token_ids": []}, "non-empty"),
                            ({"logit_bias": {"x": 1}}, "must be an integer"),
                            ({"logit_bias": [1]}, "object of token id to bias"),
                            ({"bad_words": "x"}, "list of strings")):
        with pytest.raises(InvalidRequest, match=message):
            to_knobs(read_knobs(params, from_request=False), BOUNDS, 16)


SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (json.dumps({"json": SCHEMA}),
         StructuredOutput(json_schema=json.dumps(SCHEMA, separators=(",", ":")))),
        ('{"regex": "[0-9]{2}"}', StructuredOutput(regex="[0-9]{2}")),
        ('{"choice": ["Positive", "Negative"]}',
         StructuredOutput(choice=("Positive", "Negative"))),
        (json.dumps({"grammar": 'root ::= "a"'}), StructuredOutput(grammar='root ::= "a"')),
        ('{"json_object": true}', StructuredOutput(json_object=True)),
        ({"regex": "b+"}, StructuredOutput(regex="b+")),
    ],
)
def test_structured_outputs_is_vllms_params_as_a_json_string(
    value: object, expected: StructuredOutput
) -> None:
    knobs = to_knobs(read_knobs({"structured_outputs": value}, from_request=False), BOUNDS, 16)
    assert knobs.sampling.structured == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{nope", r"parameter 'structured_outputs' must be a JSON object \(as a string\)"),
        ('["regex"]', r"parameter 'structured_outputs' must be a JSON object \(as a string\)"),
        ('{"regex": "a", "choice": ["b"]}', "You can only use one kind of structured outputs"),
        ("{}", "You must use one kind of structured outputs constraint but none"),
        ('{"choice": "b"}', "structured_outputs.choice must be a non-empty list of strings"),
        ('{"guided_json": {}}', r"structured_outputs has unknown keys \['guided_json'\]"),
    ],
)
def test_bad_structured_outputs_are_400s(value: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        read_knobs({"structured_outputs": value}, from_request=False)
    assert errors.render(caught.value).status_code == 400



@pytest.mark.parametrize(
    "value",
    [{"regex": "b+"}, '{"regex": "b+"}', {"regex": "b+", "backend": "xgrammar"},
     '{"regex": "b+", "backend": "auto"}'],
)
def test_guided_decoding_is_the_older_name_of_structured_outputs(value: object) -> None:
    knobs = to_knobs(read_knobs({"guided_decoding": value}, from_request=False), BOUNDS, 16)
    assert knobs.sampling.structured == StructuredOutput(regex="b+")


def test_structured_outputs_wins_over_guided_decoding() -> None:
    both = {"guided_decoding": {"regex": "a"}, "structured_outputs": '{"regex": "b"}'}
    knobs = to_knobs(read_knobs(both, from_request=False), BOUNDS, 16)
    assert knobs.sampling.structured == StructuredOutput(regex="b")


def test_a_guided_decoding_backend_other_than_xgrammar_is_a_400() -> None:
    with pytest.raises(InvalidRequest, match=r"guided_decoding\.backend is no longer supported"):
        read_knobs({"guided_decoding": {"regex": "a", "backend": "outlines"}}, from_request=False)

DEFAULTS = SamplingDefaults(
    temperature=0.7, top_p=0.9, top_k=40, min_p=0.1, repetition_penalty=1.05,
    presence_penalty=0.5, frequency_penalty=0.2, max_new_tokens=64,
)


def test_omitted_knobs_take_the_model_defaults() -> None:
    s = to_knobs(read_knobs({}, from_request=False), BOUNDS, 16, DEFAULTS).sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.7, 0.9, 40, 0.1)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.05, 0.5, 0.2)
    assert s.max_new_tokens is None  # the model's 64 within the room, applied by the engine
    s = to_knobs(read_knobs({}, from_request=False), BOUNDS, 16).sampling
    assert (s.temperature, s.top_k, s.max_new_tokens) == (1.0, 0, 16)  # no model defaults


def test_given_knobs_win_and_do_sample_false_stays_greedy() -> None:
    given = {"temperature": 0.2, "max_tokens": 5, "top_k": -1, "frequency_penalty": 0}
    s = to_knobs(read_knobs(given, from_request=False), BOUNDS, 16, DEFAULTS).sampling
    assert (s.temperature, s.max_new_tokens, s.top_k, s.frequency_penalty) == (0.2, 5, -1, 0.0)
    assert s.top_p == 0.9
    s = to_knobs(read_knobs({"do_sample": False}, from_request=True), BOUNDS, 20,
                 DEFAULTS).sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.0, 1.0, 0)
    assert s.repetition_penalty == 1.05 and s.max_new_tokens is None


def test_the_target_carries_the_model_defaults_to_both_infer_variants() -> None:
    text = text_call(prompt_inputs(), {}, replace(target(), defaults=DEFAULTS), route="infer")
    assert text.request.sampling.temperature == 0.7
    wire = InferRequest.model_validate({"inputs": [{"name": "input0", "shape": [2],
                                                    "datatype": "UINT32", "data": [5, 6]}]})
    call = infer_call(wire, decode_inputs(wire.inputs, None, "tiny"),
                      replace(target(), defaults=DEFAULTS))
    assert call.request.sampling.top_k == 40 and call.request.sampling.max_new_tokens is None


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_tokens": -1}, "'max_tokens' must be at least 1"),
        ({"max_new_tokens": 0}, "'max_new_tokens' must be at least 1"),
        ({"temperature": -0.5}, "non-negative"), ({"top_p": 0}, r"in \(0, 1\]"),
        ({"top_k": -2}, "-1"), ({"n": 5}, "at most 4"), ({"logprobs": 6}, "at most 5"),
        ({"stop": ["a", "b", "c"]}, "at most 2 strings"), ({"stop": ["123456789"]}, "1 to 8"),
        ({"stop": [""]}, "1 to 8"), ({"best_of": 1, "n": 2}, "at least 'n'"),
        ({"min_tokens": 5, "max_tokens": 2}, "'min_tokens' must be at most 'max_tokens'"),
        ({"max_tokens": "many"}, "must be an integer"), ({"temperature": "nan"}, "finite"),
        ({"ignore_eos": "yes"}, "boolean"), ({"stop": 5}, "string or a list"),
        ({"seed": -1}, "seed"), ({"watermark": True}, "not supported"),
        ({"typical_p": 0.5}, "not supported"), ({"timeout": 0}, "65535"),
    ],
)
def test_knob_bounds(params: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        to_knobs(read_knobs(params, from_request=True), BOUNDS, 16)


def test_server_bound_on_new_tokens_applies() -> None:
    with pytest.raises(InvalidRequest, match="at most 10"):
        to_knobs(read_knobs({"max_tokens": 11}, from_request=False),
                 RequestBounds(max_new_tokens=10), 16)


# ---- models ------------------------------------------------------------------------------------
def test_resolve_model_base_adapter_versions() -> None:
    names = {"base_names": frozenset({"tiny"}), "adapters": frozenset({"a1"})}
    assert resolve_model("tiny", None, **names) == ModelRef("tiny", None)
    assert resolve_model("a1", "1", **names) == ModelRef("a1", "a1")
    with pytest.raises(ModelNotFound, match="'x' is not found"):
        resolve_model("x", None, **names)
    with pytest.raises(ModelNotFound, match="'tiny' version 3 is not found"):
        resolve_model("tiny", "3", **names)
    with pytest.raises(InvalidRequest, match="version string 'v1'"):
        resolve_model("tiny", "v1", **names)


def test_metadata_and_config_agree_on_the_signature() -> None:
    meta, config = model_metadata(BASE), model_config(ModelRef("a1", "a1"), "tiny")
    assert [i["name"] for i in meta["inputs"]] == [i["name"] for i in config["input"]]
    types = {i["name"]: i["data_type"] for i in config["input"] + config["output"]}
    assert types["text_input"] == "TYPE_STRING" and types["cumulative_logprob"] == "TYPE_FP32"
    assert config["parameters"] == {"base_model": {"string_value": "tiny"}}


# ---- requests --------------------------------------------------------------------------------
def test_text_call_defaults_follow_the_vllm_backend() -> None:
    call = text_call(prompt_inputs("hello"), {}, target(), route="infer")
    assert call.prefix == "hello" and call.extras == () and not call.stream
    assert call.request.prompt == TextPrompt("hello")
    assert call.request.sampling.max_new_tokens == 16
    assert call.request.model == "tiny" and call.request.protocol == "kserve"
    excluded = text_call(prompt_inputs("hello", exclude_input_in_output=True), {}, target(),
                         route="generate")
    assert excluded.prefix == ""


def test_streams_never_prepend_and_refuse_explicit_false() -> None:
    call = text_call(prompt_inputs("p", stream=True), {}, target(), route="generate_stream")
    assert call.stream and call.prefix == ""
    with pytest.raises(InvalidRequest, match="exclude_input_in_output"):
        text_call(prompt_inputs("p", stream=True, exclude_input_in_output=False), {}, target(),
                  route="generate_stream")
    with pytest.raises(InvalidRequest, match="'n' must be 1"):
        text_call(prompt_inputs("p", stream=True), {"n": 2}, target(), route="generate_stream")


@pytest.mark.parametrize("flags", [{}, {"stream": False}])
def test_generate_stream_without_stream_true_answers_once_with_the_prompt(
    flags: dict[str, bool],
) -> None:
    """The vLLM backend reads a missing `stream` input as false: one response, prompt first."""
    call = text_call(prompt_inputs("p", **flags), {}, target(), route="generate_stream")
    assert not call.stream and call.prefix == "p"
    excluded = text_call(prompt_inputs("p", **flags, exclude_input_in_output=True), {}, target(),
                         route="generate_stream")
    assert excluded.prefix == ""


def test_flags_come_from_parameters_when_no_tensor_is_given() -> None:
    call = text_call(prompt_inputs("p"), {"exclude_input_in_output": "true",
                                          "return_finish_reason": True}, target(), route="infer")
    assert call.prefix == "" and call.extras == ("finish_reason",)


def test_lora_selection_by_path_or_lora_name() -> None:
    by_path = text_call(prompt_inputs(), {}, target(ModelRef("a1", "a1")), route="infer")
    assert by_path.request.model == "a1"
    by_name = text_call(prompt_inputs(), {"lora_name": "a2"}, target(), route="infer")
    assert by_name.request.model == "a2"
    same = text_call(prompt_inputs(), {"lora_name": "a1"}, target(ModelRef("a1", "a1")),
                     route="infer")
    assert same.request.model == "a1"
    with pytest.raises(InvalidRequest, match="conflicts"):
        text_call(prompt_inputs(), {"lora_name": "a2"}, target(ModelRef("a1", "a1")),
                  route="infer")
    with pytest.raises(AdapterNotFound, match=r"LoRA zz is not supported.*\['a1', 'a2'\]"):
        text_call(prompt_inputs(), {"lora_name": "zz"}, target(), route="infer")


def test_sampling_parameters_tensor_wins_and_is_strict() -> None:
    inputs = prompt_inputs()
    inputs["sampling_parameters"] = tensor("sampling_parameters", "BYTES",
                                           json.dumps({"max_tokens": 3}))
    call = text_call(inputs, {"max_tokens": 9}, target(), route="infer")
    assert call.request.sampling.max_new_tokens == 3
    inputs["sampling_parameters"] = tensor("sampling_parameters", "BYTES", "[1]")
    with pytest.raises(InvalidRequest, match="JSON object"):
        text_call(inputs, {}, target(), route="infer")
    inputs["sampling_parameters"] = tensor("sampling_parameters", "BYTES", '{"nope": 1}')
    with pytest.raises(InvalidRequest, match="Unexpected keyword argument 'nope'"):
        text_call(inputs, {}, target(), route="infer")


def test_cumulative_logprob_asks_the_engine_for_sampled_logprobs() -> None:
    call = text_call(prompt_inputs(return_cumulative_logprob=True), {}, target(), route="infer")
    assert call.request.output.logprobs == 0 and not call.logprobs_asked


def test_infer_request_timeout_is_in_microseconds() -> None:
    wire = InferRequest.model_validate({
        "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
        "parameters": {"timeout": 2_500_000},
    })
    call = infer_call(wire, decode_inputs(wire.inputs, None, "tiny"), target())
    assert isinstance(call, TextCall) and call.request.timeout_s == 2.5


def test_token_variant_reads_ids_and_item_parameters() -> None:
    wire = InferRequest.model_validate({
        "inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32", "data": [1, 2, 3],
                    "parameters": {"max_new_tokens": 4, "temperature": 0.5, "timeout": 9}}],
        "outputs": [{"name": "ids"}],
    })
    call = infer_call(wire, decode_inputs(wire.inputs, None, "tiny"), target())
    assert isinstance(call, TokenCall)
    assert call.request.prompt == TokenPrompt((1, 2, 3)) and call.output_name == "ids"
    assert call.request.sampling.max_new_tokens == 4 and call.request.timeout_s == 9


def test_token_variant_request_timeout_is_tritons_microseconds() -> None:
    wire = InferRequest.model_validate({
        "inputs": [{"name": "ids", "shape": [2], "datatype": "UINT32", "data": [1, 2]}],
        "parameters": {"timeout": 1_000_000},
    })
    call = infer_call(wire, decode_inputs(wire.inputs, None, "tiny"), target())
    assert isinstance(call, TokenCall) and call.request.timeout_s == 1.0
    assert call.output_name == "output0" and call.request.sampling.max_new_tokens == 20


@pytest.mark.parametrize(
    ("shape", "data", "message"),
    [((2, 1), [1, 2], "two-dimensional"), ((1, 1), [100], "out of range"),
     ((0,), [], "two-dimensional")],
)
def test_token_variant_checks_shape_and_vocabulary(
    shape: tuple[int, ...], data: list[int], message: str
) -> None:
    wire = InferRequest.model_validate({"inputs": [
        {"name": "input0", "shape": list(shape), "datatype": "UINT32", "data": data}]})
    with pytest.raises(InvalidRequest, match=message):
        infer_call(wire, decode_inputs(wire.inputs, None, "tiny"), target())


def test_generate_fields_maps_keys_to_inputs_and_parameters() -> None:
    client_id, inputs, params = generate_fields(
        {"id": "7", "text_input": ["q"], "stream": True, "max_tokens": 5,
         "parameters": {"temperature": 0, "stop": ["a"]}}, "tiny",
    )
    assert client_id == "7"
    assert inputs["text_input"].data == (b"q",) and inputs["stream"].data == (True,)
    assert params == {"temperature": 0, "stop": ["a"], "max_tokens": 5}
    assert generate_fields({"id": "", "text_input": "q"}, "tiny")[0] is None
    with pytest.raises(InvalidRequest, match="Unable to parse 'id'"):
        generate_fields({"id": 5, "text_input": "q"}, "tiny")


def test_output_plan_per_output_and_default_binary() -> None:
    plan = output_plan(InferRequest.model_validate({"inputs": [], "outputs": [
        {"name": "a", "parameters": {"binary_data": True}}, {"name": "b"}, {"name": "a"}]}))
    assert plan == OutputPlan(("a", "b"), frozenset({"a"}), False)
    default = output_plan(InferRequest.model_validate(
        {"inputs": [], "parameters": {"binary_data_output": True}}))
    assert default == OutputPlan(None, frozenset(), True)
    with pytest.raises(InvalidRequest, match="binary_data"):
        output_plan(InferRequest.model_validate({"inputs": [], "outputs": [
            {"name": "a", "parameters": {"binary_data": "yes"}}]}))


# ---- responses -------------------------------------------------------------------------------
def test_text_outputs_with_every_extra() -> None:
    lp = (TokenLogprob(token_id=5, token="x", logprob=-0.5,
                       top=(TopLogprob(token_id=6, token="y", logprob=-0.1),
                            TopLogprob(token_id=5, token="x", logprob=-0.5))),)
    inputs = prompt_inputs("P", return_finish_reason=True, return_cumulative_logprob=True,
                           return_logprobs=True, return_num_input_tokens=True,
                           return_num_output_tokens=True)
    call = text_call(inputs, {"logprobs": 1}, target(), route="infer")
    produced = {t.name: t for t in text_outputs(result("ab", logprobs=lp), call)}
    assert produced["text_output"].data == (b"Pab",)
    assert produced["finish_reason"].data == (b"length",)
    assert produced["cumulative_logprob"].data == (-0.5,)
    assert json.loads(produced["logprobs"].data[0]) == [{
        "5": {"logprob": -0.5, "rank": 2, "decoded_token": "x"},
        "6": {"logprob": -0.1, "rank": 1, "decoded_token": "y"},
    }]
    assert produced["num_input_tokens"].data == (2,)
    assert produced["num_output_tokens"] == Tensor("num_output_tokens", "UINT32", (1,), (2,))


def test_logprobs_output_is_null_unless_logprobs_were_asked() -> None:
    call = text_call(prompt_inputs(return_logprobs=True), {}, target(), route="infer")
    assert text_outputs(result("a"), call)[1].data == (b"null",)


def test_select_outputs_in_request_order() -> None:
    produced = [tensor("text_output", "BYTES", "t"), tensor("finish_reason", "BYTES", "stop")]
    chosen, binary = select_outputs(produced, OutputPlan(("finish_reason",), frozenset(), True))
    assert [t.name for t in chosen] == ["finish_reason"] and binary == frozenset()
    every, binary = select_outputs(produced, OutputPlan(None, frozenset(), True))
    assert len(every) == 2 and binary == {"text_output", "finish_reason"}


def test_generate_body_flattens_single_elements_and_keeps_lists_for_n() -> None:
    call = text_call(prompt_inputs("P", exclude_input_in_output=True),
                     {"n": 2, "return_finish_reason": True}, target(), route="generate")
    body = generate_body(result("a", "b"), call, response_header(BASE, None))
    assert body == {"model_name": "tiny", "model_version": "1", "text_output": ["a", "b"],
                    "finish_reason": ["length", "length"]}
    single = text_call(prompt_inputs("P"), {}, target(), route="generate")
    body = generate_body(result("a"), single, response_header(BASE, "id9"))
    assert body == {"id": "id9", "model_name": "tiny", "model_version": "1", "text_output": "Pa"}


def test_stream_folder_pairs_the_last_delta_with_done() -> None:
    call = text_call(prompt_inputs(return_finish_reason=True, return_num_output_tokens=True),
                     {}, target(), route="generate_stream")
    folder = StreamFolder(call, {"model_name": "tiny", "model_version": "1"})
    assert folder.fold(Started(prompt_token_ids=(1,))) is None
    first = folder.fold(Delta(choice=0, text="a", token_ids=(3,)))
    last = folder.fold(Delta(choice=0, text="b", token_ids=(4,), finish=FinishReason.STOP))
    assert first == {"model_name": "tiny", "model_version": "1", "text_output": "a",
                     "num_output_tokens": 1, "done": False}
    assert last == {"model_name": "tiny", "model_version": "1", "text_output": "b",
                    "finish_reason": "stop", "num_output_tokens": 1, "done": True}
    assert folder.fold(Done(usage=Usage(prompt_tokens=1, completion_tokens=2))) is None
    assert folder.close() is None


def test_stream_folder_closes_an_aborted_stream() -> None:
    call = text_call(prompt_inputs(return_finish_reason=True), {}, target(),
                     route="generate_stream")
    folder = StreamFolder(call, {})
    folder.fold(Delta(choice=0, text="a", token_ids=(3,)))
    assert folder.fold(Delta(choice=0, text="", token_ids=())) is None
    assert folder.close() == {"text_output": "", "finish_reason": "abort", "done": True}


@pytest.mark.parametrize("header", [{"model_name": "tiny", "model_version": "1"}, {}])
@pytest.mark.parametrize("flags", [{}, {"return_finish_reason": True}])
def test_plain_stream_event_is_byte_for_byte_the_folded_event(
    header: dict[str, Any], flags: dict[str, bool]
) -> None:
    call = text_call(prompt_inputs(**flags), {}, target(), route="generate_stream")
    plain, general = StreamFolder(call, header), StreamFolder(call, header)
    logprobs = (TokenLogprob(token_id=3, token="a", logprob=-0.5),)
    for delta in (Delta(choice=0, text='say "hi" é😀', token_ids=(3,)),
                  Delta(choice=0, text="", token_ids=(4,), logprobs=logprobs)):
        frame = plain.plain_frame(delta, b"data: ", b"\n\n")
        assert frame == b"data: " + jsonio.dumps(general.fold(delta)) + b"\n\n"
    last = Delta(choice=0, text="b", token_ids=(5,), finish=FinishReason.STOP)
    assert plain.plain_frame(last, b"", b"") is None
    assert plain.fold(last) == general.fold(last)  # the counts moved alike


def test_plain_stream_event_leaves_extra_outputs_to_the_folder() -> None:
    call = text_call(prompt_inputs(return_num_output_tokens=True), {}, target(),
                     route="generate_stream")
    folder = StreamFolder(call, {"model_name": "tiny"})
    assert folder.plain_frame(Delta(choice=0, text="a", token_ids=(3,)), b"", b"") is None
    assert folder.plain_frame(Delta(choice=0, text="", token_ids=()), b"", b"") is None


# ---- errors and stats ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (InvalidRequest("x"), 400), (Unsupported("x"), 400), (PayloadTooLarge("x"), 413),
        (ModelNotFound("x"), 404), (AdapterNotFound("x"), 404), (RequestNotFound("x"), 404),
        (Overloaded(), 503), (ServiceUnavailable("x"), 503), (DeadlineExceeded("x"), 504),
        (EngineError("x"), 500),
    ],
)
def test_error_table(exc: Exception, status: int) -> None:
    response = errors.render(exc)  # type: ignore[arg-type]
    assert response.status_code == status
    assert json.loads(response.body)["error"] == exc.args[0]


def test_overload_says_when_to_retry_and_stop_infer_404_is_mindie_shaped() -> None:
    assert errors.render(Overloaded(retry_after_s=3)).headers["retry-after"] == "3"
    body = json.loads(errors.render(RequestNotFound("RequestId is q not found.")).body)
    assert body == {"error": "RequestId is q not found.", "error_type": "NotFoundError"}
    assert errors.stream_error(EngineError("boom")) == b'data: {"error":"boom"}\n\n'


# ---- MindIE's stopInfer body ---------------------------------------------------------------------
@pytest.mark.parametrize("stop_id", ["a", "req-1_B", "x" * 256])
def test_stop_infer_takes_ids_of_mindies_pattern_and_keeps_the_body(stop_id: str) -> None:
    raw = json.dumps({"id": stop_id, "extra": [1]}).encode()
    assert stop_infer_id(raw) == (stop_id, {"id": stop_id, "extra": [1]})


PATTERN_MESSAGE = (
    "The id can contain only digits, letters, underscores(_), hyphens(-) and no more than 256 "
    "words in length."
)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "Failed to parse context to json body."),
        (b"{not json", "Failed to parse context to json body."),
        (b"[1]", "Not found id."),
        (b"{}", "Not found id."),
        (b'{"id": null}', "id must not be null."),
        (b'{"id": 5}', "id must be string type."),
        (b'{"id": ""}', PATTERN_MESSAGE),
        (b'{"id": "req.1"}', PATTERN_MESSAGE),
        (b'{"id": "a b"}', PATTERN_MESSAGE),
        (b'{"id": "ok\\n"}', PATTERN_MESSAGE),
        (json.dumps({"id": "x" * 257}).encode(), PATTERN_MESSAGE),
    ],
)
def test_bad_stop_infer_bodies_are_mindies_422_with_its_messages(raw: bytes, message: str) -> None:
    with pytest.raises(errors.StopInferInvalid) as caught:
        stop_infer_id(raw)
    response = errors.render(caught.value)
    assert response.status_code == 422
    assert json.loads(response.body) == {"error": message, "error_type": "Input Validation Error"}


@pytest.mark.anyio
async def test_stats_book_phases_and_failures() -> None:
    ticks = iter(range(0, 1000, 10))
    stats = InferenceStats(clock=lambda: next(ticks), wall=lambda: 12.5)
    timer = stats.timer("m")
    for _ in range(3):
        timer.mark()
    timer.success()
    timer.success()  # booked once
    stats.timer("m").failure()
    entry = (await stats.to_json(["m", "other"], "1"))["model_stats"][0]
    assert entry["inference_count"] == entry["execution_count"] == 1
    assert entry["last_inference"] == 12500
    inference = entry["inference_stats"]
    assert inference["success"] == {"count": 1, "ns": 40}
    assert inference["compute_input"] == inference["queue"] == {"count": 1, "ns": 10}
    assert inference["fail"] == {"count": 1, "ns": 10}
    other = (await stats.to_json(["other"], "1"))["model_stats"][0]
    assert other["inference_count"] == 0 and other["inference_stats"]["success"]["count"] == 0


@pytest.mark.anyio
async def test_stats_sum_every_workers_numbers() -> None:
    """Two workers' statistics (as peers answer them): one answer with both workers' counts."""
    from server.core.peers import Peers

    ticks = iter(range(0, 10_000, 10))
    there = Peers()

    async def ask_the_other(op: str, args: tuple[object, ...]) -> list[object]:
        return [await there.run_here(op, args)]

    here = Peers(ask_the_other)
    mine = InferenceStats(clock=lambda: next(ticks), wall=lambda: 1.0, peers=here)
    theirs = InferenceStats(clock=lambda: next(ticks), wall=lambda: 2.0, peers=there)
    mine.timer("m").failure()
    for stats in (mine, theirs, theirs):
        timer = stats.timer("m")
        for _ in range(3):
            timer.mark()
        timer.success()
    entry = (await mine.to_json(["m"], "1"))["model_stats"][0]
    assert entry["inference_count"] == 3
    assert entry["inference_stats"]["success"]["count"] == 3
    assert entry["inference_stats"]["fail"]["count"] == 1
    assert entry["last_inference"] == 2000
