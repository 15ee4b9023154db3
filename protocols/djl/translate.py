"""DJL translation, pure: LMI bodies → `GenerationRequest`s (their answers: `responses.py`),
adapter management forms → registrations, registry records → DJL JSON, DJL pagination.

Which adapter each input runs on (body `adapters`, `?adapter=`, the SageMaker headers, a
workflow) is chosen by `protocols/common/sagemaker.py`, shared with the other body shapes of
`/invocations`; `to_plan` takes the result.

Sampling follows LMI's vLLM mapping; a field the request leaves out takes the model's default
(its `generation_config.json`) where LMI would leave vLLM's, the greedy rule keeping temperature 0.
Structured output as LMI's vLLM path: `structured_outputs` with `response_format` applied over it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocols.common.budget import VLLM_REFUSES
from protocols.common.unserved import Neutral, refuse_unserved
from protocols.djl.schema import AdapterForm, LmiParameters, LmiRequest
from server.core.adapters import AdapterRecord, Failure
from server.core.errors import InvalidRequest, Unsupported
from server.core.frozen import quick_init
from server.core.sampling import (
    json_schema_text,
    omitted_fields,
    vllm_structured,
    with_model_defaults,
)
from server.core.types import (
    GenerationRequest,
    OutputOptions,
    Sampling,
    SamplingDefaults,
    StructuredOutput,
    TextPrompt,
)
from server.http import jsonio
from server.http.body import parse_model
from server.http.context import RequestBounds

LMI_DEFAULT_MAX_NEW_TOKENS = 30
NO_DEFAULTS = SamplingDefaults()
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "max_new_tokens")
PARSING_FAILED = "Input parsing failed: "  # LMI's prefix for a request it cannot build
DJL_LIST_LIMIT = 100
FORM_FIELDS = frozenset({"name", "src", "preload", "pin"})


# ---- DJL JSON ----------------------------------------------------------------------------------

def djl_json(content: Any) -> bytes:
    """Gson's pretty printing as DJL sends it: two-space indent, trailing newline."""
    return jsonio.pretty(content) + b"\n"


def error_body(status: int, error_type: str, message: str) -> dict[str, Any]:
    return {"code": status, "type": error_type, "message": message}


# ---- adapter management ------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Registration:
    name: str
    src: str
    preload: bool
    pin: bool
    options: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Update:
    src: str | None
    preload: bool | None
    pin: bool | None
    options: dict[str, str]


def java_bool(value: bool | str | None, default: bool) -> bool:
    """`Boolean.parseBoolean`: only "true" (any case) is true; absent keeps the default."""
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    return value.strip().lower() == "true"


def to_form(query: Mapping[str, str], body: Mapping[str, Any] | None) -> AdapterForm:
    """Query parameters (DJL) over a JSON body (vLLM's SageMaker route): a key in both takes
    the query's value. Non-string extra values of the body become JSON text options."""
    merged: dict[str, Any] = dict(body or {})
    merged.update(query)
    for key, value in list(merged.items()):
        if key not in FORM_FIELDS and not isinstance(value, str):
            merged[key] = jsonio.dumps(value).decode()
    return parse_model(AdapterForm, merged)


def _options(form: AdapterForm) -> dict[str, str]:
    return {k: str(v) for k, v in (form.model_extra or {}).items()}


def _required(value: str | None, name: str) -> str:
    if value is None or not value.strip():
        raise InvalidRequest(f"The parameter {name} is required", param=name)
    return value


def to_registration(form: AdapterForm) -> Registration:
    return Registration(
        name=_required(form.name, "name"),
        src=_required(form.src, "src"),
        preload=java_bool(form.preload, True),
        pin=java_bool(form.pin, False),
        options=_options(form),
    )


def to_update(form: AdapterForm) -> Update:
    return Update(
        src=form.src if form.src else None,
        preload=None if form.preload is None else java_bool(form.preload, True),
        pin=None if form.pin is None else java_bool(form.pin, False),
        options=_options(form),
    )


def status(message: str) -> dict[str, Any]:
    return {"status": message}


def adapter_item(record: AdapterRecord) -> dict[str, Any]:
    """One adapter as DJL lists it; `residency` is ours (registered | cpu_cache | engine_slot)."""
    return {
        "name": record.name, "src": record.src, "preload": record.preload, "pin": record.pin,
        "residency": record.residency.value,
    }


def describe(record: AdapterRecord, *, engine_loaded: bool) -> dict[str, Any]:
    """DJL's describe object plus our own fields (DJL clients ignore unknown fields)."""
    return {
        **adapter_item(record),
        "loraId": record.handle.int_id,
        "engineLoaded": engine_loaded,
        "rank": record.rank,
        "inflight": record.inflight,
        "requests": record.requests,
        "generatedTokens": record.generated_tokens,
        "loads": record.loads,
        "coldLoads": record.cold_loads,
        "loadSecondsTotal": round(record.load_seconds, 6),
        "evictions": record.evictions,
        "origin": record.origin,
        "digest": record.digest,
        **({"options": record.options} if record.options else {}),
    }


def describe_failed(name: str, failure: Failure) -> dict[str, Any]:
    """A folder adapter that was refused: never routed to, shown with its reason."""
    return {"name": name, "src": failure.path, "status": "failed", "reason": failure.reason}


def _int_param(query: Mapping[str, str], name: str, default: int) -> int:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        message = f"Invalid value for parameter {name}: {raw[:32]}"
        raise InvalidRequest(message, param=name) from None


def page(query: Mapping[str, str], total: int) -> tuple[int, int, str | None]:
    """DJL's `ListPagination`: (start, end, nextPageToken). A limit above 100 or below 0 is 100,
    a negative token is 0; the token is present only while items remain."""
    limit = _int_param(query, "limit", DJL_LIST_LIMIT)
    start = _int_param(query, "next_page_token", 0)
    if limit > DJL_LIST_LIMIT or limit < 0:
        limit = DJL_LIST_LIMIT
    start = max(start, 0)
    end = min(start + limit, total)
    return start, end, str(end) if end < total else None


def to_list(records: Sequence[AdapterRecord], query: Mapping[str, str]) -> dict[str, Any]:
    start, end, token = page(query, len(records))
    body: dict[str, Any] = {}
    if token is not None:
        body["nextPageToken"] = token
    body["adapters"] = [adapter_item(r) for r in records[start:end]]
    return body


# ---- inference: request ----------------------------------------------------------------------

def input_texts(body: LmiRequest, bounds: RequestBounds) -> list[str]:
    texts = [body.inputs] if isinstance(body.inputs, str) else list(body.inputs)
    if not texts:
        raise InvalidRequest("inputs must not be empty", param="inputs")
    if len(texts) > bounds.max_prompts:
        raise InvalidRequest(
            f"Too many inputs: {len(texts)} > {bounds.max_prompts}", param="inputs"
        )
    return texts


def _stops(p: LmiParameters, bounds: RequestBounds) -> tuple[str, ...]:
    raw = p.stop_sequences if p.stop_sequences is not None else p.stop
    stops = (raw,) if isinstance(raw, str) else tuple(raw or ())
    if len(stops) > bounds.max_stop_sequences:
        raise InvalidRequest(
            f"Too many stop sequences: {len(stops)} > {bounds.max_stop_sequences}",
            param="parameters.stop_sequences",
        )
    if any(not s or len(s) > bounds.max_stop_length for s in stops):
        raise InvalidRequest(
            f"Each stop sequence must have 1 to {bounds.max_stop_length} characters",
            param="parameters.stop_sequences",
        )
    return stops


def _counts(p: LmiParameters, bounds: RequestBounds) -> tuple[int, int | None, int]:
    n = p.n or 1
    if n > bounds.max_n:
        raise InvalidRequest(f"n must be at most {bounds.max_n}", param="parameters.n")
    if p.best_of is not None and not n <= p.best_of <= bounds.max_best_of:
        raise InvalidRequest(
            f"best_of must be between n ({n}) and {bounds.max_best_of}", param="parameters.best_of"
        )
    max_new = p.max_new_tokens or LMI_DEFAULT_MAX_NEW_TOKENS
    if bounds.max_new_tokens is not None and max_new > bounds.max_new_tokens:
        raise InvalidRequest(
            f"max_new_tokens must be at most {bounds.max_new_tokens}",
            param="parameters.max_new_tokens",
        )
    if p.top_k is not None and p.top_k < -1:
        raise InvalidRequest("top_k must be -1 (disabled) or at least 1", param="parameters.top_k")
    return n, p.best_of, max_new


# LMI's vLLM parameters (lmi_input_output_schema.md) the engine port does not carry
LMI_UNSERVED: Neutral = {
    "num_beams": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1.0),
    "early_stopping": (None, False), "logprobs": (None,), "prompt_logprobs": (None,),
}


def to_sampling(
    p: LmiParameters, bounds: RequestBounds, defaults: SamplingDefaults = NO_DEFAULTS
) -> Sampling:
    """LMI's vLLM mapping: greedy unless `do_sample` is true or a temperature is given without
    `do_sample`; what the request leaves out takes the model's `defaults`, else LMI's own
    (`max_new_tokens` 30)."""
    refuse_unserved(p.model_dump(exclude_unset=True), LMI_UNSERVED, prefix="parameters.")
    n, best_of, max_new = _counts(p, bounds)
    greedy = p.do_sample is False or (p.do_sample is None and p.temperature is None)
    sampling = Sampling(
        max_new_tokens=max_new,
        budget=VLLM_REFUSES,
        min_new_tokens=p.min_new_tokens or 0,
        temperature=0.0 if greedy else (1.0 if p.temperature is None else p.temperature),
        top_p=1.0 if p.top_p is None else p.top_p,
        top_k=p.top_k or 0,
        min_p=p.min_p or 0.0,
        seed=p.seed,
        repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
        presence_penalty=p.presence_penalty or 0.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        n=n,
        best_of=best_of,
        stop=_stops(p, bounds),
        stop_token_ids=tuple(p.stop_token_ids or ()),
        ignore_eos=bool(p.ignore_eos_token or p.ignore_eos),
        skip_special_tokens=p.skip_special_tokens is not False,
        include_stop_str_in_output=bool(p.include_stop_str_in_output),
        spaces_between_special_tokens=p.spaces_between_special_tokens is not False,
        structured=to_structured(p),
    )
    return with_model_defaults(sampling, defaults, omitted_fields(p, DEFAULTED), greedy=greedy)


def to_structured(p: LmiParameters) -> StructuredOutput | None:
    """`structured_outputs` (vLLM's dict) with `response_format` applied over it as vLLM does
    (json_object / json_schema replace that kind of constraint; two kinds are refused), or
    `json_schema` on its own. Errors carry LMI's "Input parsing failed: " prefix."""
    try:
        return _structured(p)
    except InvalidRequest as exc:
        raise type(exc)(PARSING_FAILED + exc.message, param=exc.param) from None


def _structured(p: LmiParameters) -> StructuredOutput | None:
    spec = p.structured_outputs
    override = _response_format(p.response_format)
    if override is not None:
        spec = {**(spec or {}), **override}
    if p.json_schema is None:
        return None if spec is None else vllm_structured(
            spec, param="parameters.structured_outputs"
        )
    if spec is not None:
        raise InvalidRequest(
            "json_schema cannot be combined with structured_outputs or response_format: "
            "give one constraint",
            param="parameters.json_schema",
        )
    return StructuredOutput(json_schema=json_schema_text(p.json_schema, "parameters.json_schema"))


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's `response_format` as the structured-output constraint it stands for."""
    kind = None if fmt is None else fmt.get("type")
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if spec is None:
            raise InvalidRequest(
                "When response_format type is 'json_schema', the 'json_schema' field must be "
                "provided.",
                param="parameters.response_format",
            )
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest(
                "response_format.json_schema.schema must be a JSON object",
                param="parameters.response_format",
            )
        return {"json": schema}
    raise Unsupported(
        f"response_format type {str(kind)[:32]!r} is not supported by this server",
        param="parameters.response_format",
    )


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A parsed LMI request: one generation per input, and how to render the answer."""

    requests: tuple[GenerationRequest, ...]
    inputs: tuple[str, ...]
    single: bool  # `inputs` was a string: answer with an object, not a list
    stream: bool
    details: bool
    prefill: bool
    full_text: bool
    seed: int | None = None
    legacy: bool = False  # LMI's rolling-batch schema (option.rolling_batch=vllm), else async's


def to_plan(
    body: LmiRequest,
    *,
    request_id: str,
    models: Sequence[str],
    bounds: RequestBounds,
    defaults: SamplingDefaults = NO_DEFAULTS,
    legacy: bool = False,
) -> Plan:
    """`models[i]` is what input i runs on: "" (base), an adapter or a workflow name. `legacy`
    answers in LMI's rolling-batch schema (`responses.py`), else in its async mode's."""
    p = body.parameters or LmiParameters()
    texts = input_texts(body, bounds)
    sampling = to_sampling(p, bounds, defaults)
    stream = bool(body.stream)
    if stream and (len(texts) > 1 or sampling.n > 1):
        raise InvalidRequest("Streaming supports one input and n = 1 only", param="stream")
    prefill = bool(p.decoder_input_details)  # each input of a list gets its own, as in LMI
    output = OutputOptions(
        logprobs=0 if stream or p.details else None, prompt_logprobs=0 if prefill else None
    )
    requests = tuple(
        GenerationRequest(
            request_id=request_id, model=model, prompt=TextPrompt(text), sampling=sampling,
            output=output, stream=stream, protocol="djl",
        )
        for text, model in zip(texts, models, strict=True)
    )
    return Plan(
        requests=requests, inputs=tuple(texts), single=isinstance(body.inputs, str),
        stream=stream, details=bool(p.details), prefill=prefill,
        full_text=bool(p.return_full_text), seed=p.seed, legacy=legacy,
    )
