"""Property tests on every protocol's translator (B.7 #28 "atheris on the protocol translators",
done with hypothesis): any JSON value in → either a domain error (`GatewayError`, which every
protocol renders as its own 4xx) or a valid `GenerationRequest`, never another exception.

Each case runs the same chain the route runs: body JSON → wire model (`parse_model`) → pure
translation, with the server's default bounds. Inputs are arbitrary JSON, and JSON shaped like
each protocol's body with arbitrary values in the known keys (so validation passes often enough
to reach the translators' own checks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.common.sagemaker import Selectors
from protocols.djl import schema as djl_schema
from protocols.djl import translate as djl
from protocols.kserve_v2 import schema as kserve_schema
from protocols.kserve_v2 import translate as kserve
from protocols.kserve_v2.models import ModelRef
from protocols.mindie import schema as mindie_schema
from protocols.mindie import translate as mindie
from protocols.openai_v1 import requests as openai
from protocols.openai_v1 import schema as openai_schema
from protocols.tgi import schema as tgi_schema
from protocols.tgi import translate as tgi
from server.core.budget import fit
from server.core.errors import GatewayError, InvalidRequest
from server.core.types import GenerationRequest, Sampling
from server.http import jsonio
from server.http.body import decode_json, parse_model
from server.http.context import RequestBounds
from server.http.streaming import sse_event

BOUNDS = RequestBounds()
MAX_MODEL_LEN = 512
VOCAB = 1000

# What the one JSON decoder (orjson) can hand a route: integers within [-2**63, 2**64 - 1]
# (larger ones arrive as floats), finite floats, any text.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=25,
)
small_ints = st.integers(min_value=-3, max_value=40) | st.integers(-(2**63), 2**64 - 1)
VALUES = (
    scalars
    | small_ints
    | st.lists(st.text(max_size=8) | small_ints, max_size=6)
    | st.lists(st.lists(small_ints, max_size=4), max_size=3)
    | json_values
)


def shaped(keys: list[str], nested: dict[str, list[str]] | None = None) -> st.SearchStrategy[Any]:
    """Dicts over a protocol's own keys (some of them), each with an arbitrary value."""
    fields: dict[str, st.SearchStrategy[Any]] = dict.fromkeys(keys, VALUES)
    for key, inner in (nested or {}).items():
        fields[key] = st.fixed_dictionaries({}, optional=dict.fromkeys(inner, VALUES)) | VALUES
    return st.fixed_dictionaries({}, optional=fields)


def bodies(keys: list[str], nested: dict[str, list[str]] | None = None) -> st.SearchStrategy[Any]:
    return shaped(keys, nested) | json_values


def fields_of(model: Any) -> list[str]:
    return list(model.model_fields)


# Plausible values: the right types in and around the legal ranges, so that many cases pass
# validation and reach the translators' own checks and the request they build.
TEXT = st.text(max_size=24)
COUNT = st.integers(min_value=-1, max_value=40)
FRACTION = st.floats(min_value=-0.5, max_value=2.5, allow_nan=False)
TOKENS = st.lists(st.integers(min_value=-1, max_value=1200), max_size=6)
STOPS = TEXT | st.lists(TEXT, max_size=20)
MODEL = st.sampled_from(["tiny", "a1", "", "nope"])
SAMPLING = {
    "temperature": FRACTION, "top_p": FRACTION, "top_k": COUNT, "seed": COUNT,
    "repetition_penalty": FRACTION, "do_sample": st.booleans(), "stop": STOPS,
}


def plausible(fields: dict[str, st.SearchStrategy[Any]],
              required: dict[str, st.SearchStrategy[Any]] | None = None) -> st.SearchStrategy[Any]:
    """A body with well-typed values in up to four of its known keys (three times out of
    four), else arbitrary values."""
    names = sorted(fields)
    body = st.lists(st.sampled_from(names), max_size=4, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({**(required or {}), **{k: fields[k] for k in keys}})
    )
    return st.one_of(body, body, body, bodies(names))


def message() -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries({
        "role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
        "content": TEXT | st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]), "text": TEXT}), max_size=2),
    })


def assert_valid(request: GenerationRequest) -> None:
    assert isinstance(request, GenerationRequest)
    sampling: Sampling = request.sampling
    assert 1 <= sampling.n <= BOUNDS.max_n
    assert sampling.max_new_tokens is None or sampling.max_new_tokens >= 0
    assert len(sampling.stop) <= BOUNDS.max_stop_sequences
    if request.output.logprobs is not None:
        assert 0 <= request.output.logprobs <= BOUNDS.max_logprobs


def domain_error_or_valid(translate: Callable[[Any], list[GenerationRequest]], data: Any) -> None:
    try:
        requests = translate(data)
    except GatewayError:
        return
    assert requests
    for request in requests:
        assert_valid(request)


PROPERTY = settings(
    max_examples=300, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# ---- OpenAI --------------------------------------------------------------------------------------
def openai_chat(data: Any) -> list[GenerationRequest]:
    body = parse_model(openai_schema.ChatCompletionRequest, data)
    return [openai.chat_request(body, request_id="r", bounds=BOUNDS)]


def openai_completions(data: Any) -> list[GenerationRequest]:
    body = parse_model(openai_schema.CompletionRequest, data)
    return openai.completion_requests(body, request_id="r", bounds=BOUNDS)


OPENAI_COMMON = {
    **SAMPLING, "model": MODEL, "n": COUNT, "max_tokens": COUNT, "stream": st.booleans(),
    "presence_penalty": FRACTION, "min_tokens": COUNT, "ignore_eos": st.booleans(),
    "stop_token_ids": TOKENS, "logit_bias": st.dictionaries(st.sampled_from(["1", "x"]),
                                                            FRACTION),
}
CHAT_FIELDS = {
    **OPENAI_COMMON, "logprobs": st.booleans(), "top_logprobs": COUNT,
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.dictionaries(TEXT, VALUES, max_size=3),
    "tools": st.none() | st.lists(st.dictionaries(TEXT, VALUES, max_size=2), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto"]), "max_completion_tokens": COUNT,
}
COMPLETION_FIELDS = {**OPENAI_COMMON, "logprobs": COUNT, "echo": st.booleans(), "suffix": TEXT}
PROMPTS = TEXT | st.lists(TEXT, max_size=3) | TOKENS | st.lists(TOKENS, max_size=3)


@PROPERTY
@given(data=plausible(CHAT_FIELDS, {"messages": st.lists(message(), max_size=3)})
       | bodies(fields_of(openai_schema.ChatCompletionRequest)))
def test_openai_chat_translator(data: Any) -> None:
    domain_error_or_valid(openai_chat, data)


@PROPERTY
@given(
    data=plausible(COMPLETION_FIELDS, {"prompt": PROMPTS})
    | bodies(fields_of(openai_schema.CompletionRequest))
)
def test_openai_completions_translator(data: Any) -> None:
    domain_error_or_valid(openai_completions, data)


# ---- TGI -----------------------------------------------------------------------------------------
def tgi_generate(data: Any, *, stream: bool) -> list[GenerationRequest]:
    limits = tgi.Limits.of(BOUNDS, MAX_MODEL_LEN)
    body = parse_model(tgi_schema.GenerateRequest, data)
    plan = tgi.plan(body, limits, stream=stream)
    prompt_tokens = min(len(body.inputs), 600)  # as the engine tokenizes them
    request = tgi.to_generation_request(plan, request_id="r")
    s = request.sampling
    budget = fit(
        prompt_tokens, MAX_MODEL_LEN, truncate=s.truncate_prompt_tokens,
        max_tokens=s.max_new_tokens, default_max_tokens=None, policy=s.budget,
    )
    return [replace(request, sampling=replace(s, max_new_tokens=budget.max_tokens))]


TGI_PARAMETERS = {
    **SAMPLING, "max_new_tokens": COUNT, "best_of": COUNT, "details": st.booleans(),
    "decoder_input_details": st.booleans(), "top_n_tokens": COUNT, "truncate": COUNT,
    "return_full_text": st.booleans(), "typical_p": FRACTION, "watermark": st.booleans(),
    "adapter_id": MODEL, "stop": st.lists(TEXT, max_size=6), "seed": st.integers(0, 2**64 - 1),
}


@PROPERTY
@given(
    data=plausible({"parameters": plausible(TGI_PARAMETERS), "stream": st.booleans()},
                   {"inputs": TEXT})
    | bodies(["inputs", "stream"], {"parameters": fields_of(tgi_schema.Parameters)}),
    stream=st.booleans(),
)
def test_tgi_translator(data: Any, stream: bool) -> None:
    domain_error_or_valid(lambda d: tgi_generate(d, stream=stream), data)


# ---- KServe v2 / Triton -------------------------------------------------------------------------
TARGET = kserve.Target(
    model=ModelRef("tiny"), request_id="r", client_id=None, bounds=BOUNDS,
    adapters=frozenset({"a1"}), vocab_size=VOCAB,
)
TENSOR = st.fixed_dictionaries(
    {"name": st.sampled_from(["text_input", "input_ids", "stream", "x"]) | st.text(max_size=6)},
    optional={
        "shape": st.lists(small_ints, max_size=3) | VALUES,
        "datatype": st.sampled_from(["BYTES", "UINT32", "BOOL", "INT64", "FP32"]) | VALUES,
        "data": VALUES,
        "parameters": VALUES,
    },
)


def kserve_infer(data: Any) -> list[GenerationRequest]:
    wire = parse_model(kserve_schema.InferRequest, data)
    call = kserve.infer_call(wire, kserve.decode_inputs(wire.inputs, None, "tiny"), TARGET)
    return [call.request]


def kserve_generate(data: Any) -> list[GenerationRequest]:
    _, inputs, params = kserve.generate_fields(data, "tiny")
    return [kserve.text_call(inputs, params, TARGET, route="generate").request]


TEXT_TENSOR = st.fixed_dictionaries({
    "name": st.just("text_input"), "shape": st.just([1]), "datatype": st.just("BYTES"),
    "data": st.lists(TEXT, min_size=1, max_size=1),
})
TOKEN_TENSOR = st.fixed_dictionaries({
    "name": st.just("input_ids"), "shape": st.lists(st.integers(0, 6), max_size=2),
    "datatype": st.just("UINT32"), "data": TOKENS,
})
KSERVE_PARAMETERS = {"max_tokens": COUNT, "temperature": FRACTION, "top_k": COUNT,
                     "lora_name": MODEL, "timeout": COUNT, "n": COUNT}


@PROPERTY
@given(data=json_values | st.fixed_dictionaries(
    {"inputs": st.lists(TENSOR, max_size=3)}, optional={"id": VALUES, "parameters": VALUES,
                                                       "outputs": VALUES},
) | st.fixed_dictionaries(
    {"inputs": st.lists(TEXT_TENSOR | TOKEN_TENSOR, min_size=1, max_size=2)},
    optional={"parameters": plausible(KSERVE_PARAMETERS), "id": TEXT},
))
def test_kserve_infer_translator(data: Any) -> None:
    domain_error_or_valid(kserve_infer, data)


GENERATE_KEYS = ["text_input", "stream", "sampling_parameters", "exclude_input_in_output",
                 "max_tokens", "temperature", "top_k", "n", "lora_name", "id", "timeout"]


@PROPERTY
@given(data=bodies(GENERATE_KEYS, {"parameters": GENERATE_KEYS}) | plausible(
    {**KSERVE_PARAMETERS, "stream": st.booleans(), "exclude_input_in_output": st.booleans(),
     "parameters": plausible(KSERVE_PARAMETERS)},
    {"text_input": TEXT},
))
def test_kserve_generate_translator(data: Any) -> None:
    domain_error_or_valid(kserve_generate, data)


# ---- MindIE -------------------------------------------------------------------------------------
def mindie_infer(data: Any) -> list[GenerationRequest]:
    if not isinstance(data, dict):  # as the route does before the translator
        raise InvalidRequest("Failed to parse request context to json")
    prompt = mindie.infer_prompt(data)
    body = parse_model(mindie_schema.InferRequest, data)
    return [mindie.infer_request(body, prompt, request_id="r").request]


def mindie_vllm(data: Any) -> list[GenerationRequest]:
    body = parse_model(mindie_schema.VllmGenerateRequest, data)
    return [mindie.vllm_request(body, request_id="r", bounds=BOUNDS, vocab_size=VOCAB).request]


MINDIE_PARAMETERS = {
    **SAMPLING, "max_new_tokens": COUNT, "details": st.booleans(), "timeout": COUNT,
    "priority": COUNT, "typical_p": FRACTION, "watermark": st.booleans(),
}


@PROPERTY
@given(data=shaped(["inputs", "input_id", "stream", "id"],
                   {"parameters": fields_of(mindie_schema.InferParameters)})
       | plausible({"parameters": plausible(MINDIE_PARAMETERS), "stream": st.booleans(),
                    "id": TEXT}, {"inputs": TEXT})
       | plausible({"parameters": plausible(MINDIE_PARAMETERS)}, {"input_id": TOKENS}))
def test_mindie_infer_translator(data: Any) -> None:
    domain_error_or_valid(mindie_infer, data)


@PROPERTY
@given(data=bodies(fields_of(mindie_schema.VllmGenerateRequest)) | plausible(
    {**SAMPLING, "max_tokens": COUNT, "n": COUNT, "best_of": COUNT, "model": MODEL,
     "stop_token_ids": TOKENS, "stream": st.booleans(), "ignore_eos": st.booleans()},
    {"prompt": TEXT},
))
def test_mindie_vllm_translator(data: Any) -> None:
    domain_error_or_valid(mindie_vllm, data)


# ---- DJL / SageMaker ----------------------------------------------------------------------------
def djl_invocation(data: Any) -> list[GenerationRequest]:
    body = parse_model(djl_schema.LmiRequest, data)
    texts = djl.input_texts(body, BOUNDS)
    models = Selectors().names(len(texts), body.adapters) or [""] * len(texts)
    return list(djl.to_plan(body, request_id="r", models=models, bounds=BOUNDS).requests)


LMI_PARAMETERS = {
    **SAMPLING, "max_new_tokens": COUNT, "n": COUNT, "best_of": COUNT,
    "details": st.booleans(), "decoder_input_details": st.booleans(),
    "return_full_text": st.booleans(), "stop_sequences": STOPS, "min_p": FRACTION,
}


@PROPERTY
@given(data=bodies(["inputs", "stream", "adapters"],
                   {"parameters": fields_of(djl_schema.LmiParameters)})
       | plausible({"parameters": plausible(LMI_PARAMETERS), "stream": st.booleans(),
                    "adapters": MODEL | st.lists(MODEL, max_size=3)},
                   {"inputs": TEXT | st.lists(TEXT, max_size=3)}))
def test_djl_translator(data: Any) -> None:
    domain_error_or_valid(djl_invocation, data)


@PROPERTY
@given(query=st.dictionaries(st.sampled_from(["name", "src", "preload", "pin", "x"]),
                             st.text(max_size=20), max_size=4),
       body=st.none() | st.dictionaries(st.text(max_size=6), VALUES, max_size=4))
def test_djl_adapter_form_translator(query: dict[str, str], body: Any) -> None:
    try:
        djl.to_registration(djl.to_form(query, body))
    except GatewayError:
        pass


# ---- the JSON decoder in front of all of them ------------------------------------------------
@PROPERTY
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_body_decoder_gives_json_or_a_domain_error(raw: bytes) -> None:
    try:
        decode_json(raw)
    except GatewayError:
        pass


@PROPERTY
@given(text=st.text())
def test_sse_framing_survives_any_generated_text(text: str) -> None:
    """A token text with newlines, CRs or NULs never splits or ends an SSE event early."""
    event = sse_event(jsonio.dumps({"text": text}))
    assert event.startswith(b"data: ")
    assert event.endswith(b"\n\n")
    assert event.count(b"\n") == 2 and b"\r" not in event and b"\x00" not in event
    assert jsonio.loads(event.removeprefix(b"data: "))["text"] == text
