"""Pure translation: Triton / KServe v2 wire data ⇄ `GenerationRequest` and results.

Owns the two `/infer` variants (text tensors as the Triton vLLM backend takes them; MindIE's
UINT32 token ids), the generate extension's body mapping, and the response shapes (infer tensors,
flattened generate objects, stream events). No I/O here.

Choices (documented where clients see them):
- text routes default to 16 new tokens (vLLM `SamplingParams`, what the vLLM backend uses); the
  MindIE token variant defaults to 20 (`max_new_tokens` in MindIE); a model with its own
  defaults (`generation_config.json`) overrides both and every omitted sampling knob (the
  backend itself would not read them: one server, one rule);
- `exclude_input_in_output` defaults to false off-stream: `text_output` is prompt + completion,
  as the vLLM backend answers; streams never repeat the prompt (explicit false is refused there);
- `generate_stream` streams only with a `stream: true` input, as the vLLM backend: without it
  the answer is one event (prompt + completion unless `exclude_input_in_output`);
- the path model selects the adapter (one Triton model per adapter); `lora_name` (request
  parameters or the `sampling_parameters` JSON) selects one when the path names the base model;
- requesting an extra output (e.g. `finish_reason`) implies its `return_*` input;
- `n` > 1 gives BYTES outputs of n elements off-stream; streams need n = 1.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from protocols.common.request_id import CLIENT_REQUEST_ID
from protocols.kserve_v2 import tensors
from protocols.kserve_v2.errors import StopInferInvalid
from protocols.kserve_v2.models import (
    EXTRA_FLAGS,
    INPUT_SPECS,
    INPUTS,
    MODEL_VERSION,
    OUTPUT_NAMES,
    ModelRef,
)
from protocols.kserve_v2.sampling import Knobs, read_knobs, to_bool, to_knobs
from protocols.kserve_v2.schema import InferInput, InferRequest, RequestedOutput
from protocols.kserve_v2.tensors import Tensor
from server.core.errors import AdapterNotFound, InvalidRequest, Unsupported
from server.core.frozen import quick_init
from server.core.types import (
    Choice,
    Delta,
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
    OutputOptions,
    Prompt,
    SamplingDefaults,
    Started,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
)
from server.http import jsonio
from server.http.context import RequestBounds

TEXT_MAX_TOKENS = 16
TOKEN_MAX_NEW_TOKENS = 20
MAX_TOKEN_IDS = 1_048_576
Route = Literal["infer", "generate", "generate_stream"]


# ---- the request side --------------------------------------------------------------------------
@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """Who a request is for and under which limits (built by the route from the service)."""

    model: ModelRef
    request_id: str  # the engine-facing id; stopInfer finds the request by it
    client_id: str | None  # the id the client sent (echoed only when non-empty)
    bounds: RequestBounds
    adapters: Collection[str]  # the registry: `in` also finds adapterDir folders
    vocab_size: int
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class TextCall:
    request: GenerationRequest
    prefix: str  # prepended to text_output (the prompt, or "")
    extras: tuple[str, ...]  # extra outputs to produce, in signature order
    logprobs_asked: bool  # False: `logprobs` outputs are "null", as in the vLLM backend
    details: bool = False  # MindIE `details` on the generate routes
    stream: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenCall:
    """MindIE's token-in/token-out `/infer`: one UINT32 input, one UINT32 output."""

    request: GenerationRequest
    output_name: str


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """Which outputs an infer response carries, and which of them as binary data."""

    names: tuple[str, ...] | None  # None: every produced output
    binary: frozenset[str]
    binary_default: bool  # `binary_data_output`, for outputs that were not listed


def decode_inputs(inputs: Sequence[InferInput], raw: bytes | None, model: str) -> list[Tensor]:
    """Input tensors from JSON `data` or from the binary section (`raw`; None = no header)."""
    decoded: list[Tensor] = []
    offset = 0
    for item in inputs:
        dtype = tensors.datatype(item.datatype, item.name)
        shape = tuple(item.shape)
        size = _binary_size(item)
        if size is None:
            decoded.append(tensors.from_json(item.name, dtype, shape, item.data))
            continue
        if raw is None:
            raise InvalidRequest(
                "must specify valid 'Infer-Header-Content-Length' in request header and "
                "'binary_data_size' when passing inputs in binary data format"
            )
        if offset + size > len(raw):
            raise InvalidRequest(
                f"unexpected size for input '{item.name}', expecting {offset + size - len(raw)} "
                f"additional bytes for model '{model}'"
            )
        decoded.append(tensors.from_binary(item.name, dtype, shape, raw[offset : offset + size]))
        offset += size
    if raw is not None and offset != len(raw):
        raise InvalidRequest(f"unexpected additional input data for model '{model}'")
    return decoded


def _binary_size(item: InferInput) -> int | None:
    params = item.parameters or {}
    if "shared_memory_region" in params:
        raise Unsupported("shared memory tensors are not supported by this server")
    size = item.binary_size
    if (size is None) == (not item.has_data):
        found = "no field is set" if size is None else "set 'data' 'binary_data_size'"
        raise InvalidRequest(
            "Input must set only one of the following fields: 'data', 'binary_data_size' in "
            f"'parameters', 'shared_memory_region' in 'parameters'. But {found}"
        )
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise InvalidRequest("Unable to parse 'binary_data_size'")
    return size


def output_plan(wire: InferRequest) -> OutputPlan:
    default = _flag_param(wire.parameters, "binary_data_output")
    if not wire.outputs:
        return OutputPlan(None, frozenset(), default)
    names: list[str] = []
    binary: set[str] = set()
    for out in wire.outputs:
        if out.name not in names:
            names.append(out.name)
        if _flag_param(out.parameters, "binary_data"):
            binary.add(out.name)
    return OutputPlan(tuple(names), frozenset(binary), default)


def _flag_param(params: Mapping[str, Any] | None, name: str) -> bool:
    value = (params or {}).get(name, False)
    if not isinstance(value, bool):
        raise InvalidRequest(f"Unable to parse '{name}'")
    return value


def is_token_request(inputs: Sequence[Tensor]) -> bool:
    """MindIE's variant: a single UINT32 tensor of token ids, under any non-vLLM name."""
    return len(inputs) == 1 and inputs[0].datatype == "UINT32" and inputs[0].name not in INPUT_SPECS


def infer_call(
    wire: InferRequest, inputs: Sequence[Tensor], target: Target
) -> TextCall | TokenCall:
    """`POST …/infer` → a call, validated against the model's signature before any work."""
    params = dict(wire.parameters or {})
    timeout_us = params.pop("timeout", None)  # Triton: the request timeout, in microseconds
    call: TextCall | TokenCall
    if is_token_request(inputs):
        call = token_call(wire, inputs[0], target, params)
    else:
        call = text_call(
            check_text_inputs(inputs, target.model.name), params, target, route="infer",
            requested=output_plan(wire).names,
        )
    if timeout_us is None:
        return call
    return replace(call, request=replace(call.request, timeout_s=_timeout_us(timeout_us)))


def _timeout_us(raw: object) -> float | None:
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise InvalidRequest("Unable to parse 'timeout'")
    return raw / 1_000_000 or None


def check_text_inputs(inputs: Sequence[Tensor], model: str) -> dict[str, Tensor]:
    """Inputs keyed by name; Triton's errors for unknown, duplicate, mistyped, misshaped ones."""
    found: dict[str, Tensor] = {}
    for tensor in inputs:
        spec = INPUT_SPECS.get(tensor.name)
        if spec is None:
            raise InvalidRequest(f"unexpected inference input '{tensor.name}' for model '{model}'")
        if tensor.name in found:
            raise InvalidRequest(f"input '{tensor.name}' already exists in request")
        if tensor.datatype != spec.datatype:
            raise InvalidRequest(
                f"inference input '{tensor.name}' data-type is '{tensor.datatype}', but model "
                f"'{model}' expects '{spec.datatype}'"
            )
        if len(tensor.data) != 1:
            raise InvalidRequest(
                f"unexpected shape for input '{tensor.name}' for model '{model}'. Expected "
                f"{list(spec.dims)}, got {list(tensor.shape)}"
            )
        found[tensor.name] = tensor
    if "text_input" not in found:
        raise InvalidRequest(
            f"expected number of inputs between 1 and {len(INPUTS)} but got {len(found)} inputs "
            f"for model '{model}'. Got input(s) {sorted(found)}, but missing required input(s) "
            "['text_input']. Please provide all required input(s)."
        )
    return found


def text_call(
    inputs: Mapping[str, Tensor], params: Mapping[str, object], target: Target, *,
    route: Route, requested: tuple[str, ...] | None = None,
) -> TextCall:
    """The vLLM backend's reading of the tensors, with request parameters as the fallback."""
    prompt = _text(inputs["text_input"])
    flags = _flags(inputs, params)
    for name in requested or ():
        if name not in OUTPUT_NAMES:
            raise InvalidRequest(
                f"unexpected inference output '{name}' for model '{target.model.name}'"
            )
        if name in EXTRA_FLAGS:
            flags[EXTRA_FLAGS[name]] = True
    knobs = to_knobs(
        read_knobs(params, from_request=True)
        | read_knobs(_sampling_json(inputs), from_request=False),
        target.bounds, TEXT_MAX_TOKENS, target.defaults,
    )
    streaming = _streaming(flags.get("stream"), route)
    if streaming and knobs.sampling.n != 1:
        raise InvalidRequest("parameter 'n' must be 1 when streaming", param="n")
    extras = tuple(name for name, flag in EXTRA_FLAGS.items() if flags.get(flag))
    logprobs = knobs.logprobs if knobs.logprobs is not None else (
        0 if "cumulative_logprob" in extras else None
    )
    return TextCall(
        request=_request(target, TextPrompt(prompt), knobs, stream=streaming, logprobs=logprobs),
        prefix=_prefix(prompt, flags.get("exclude_input_in_output"), streaming),
        extras=extras, logprobs_asked=knobs.logprobs is not None, details=knobs.details,
        stream=streaming,
    )


def _text(tensor: Tensor) -> str:
    value = tensor.data[0]
    try:
        return value.decode() if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise InvalidRequest(f"input '{tensor.name}' is not valid UTF-8") from None


def _flags(inputs: Mapping[str, Tensor], params: Mapping[str, object]) -> dict[str, bool]:
    """BOOL inputs; a request parameter of the same name stands in for an absent tensor."""
    flags: dict[str, bool] = {}
    for spec in INPUTS:
        if spec.datatype != "BOOL":
            continue
        if spec.name in inputs:
            flags[spec.name] = bool(inputs[spec.name].data[0])
        elif spec.name in params:
            flags[spec.name] = to_bool(spec.name, params[spec.name])
    return flags


def _sampling_json(inputs: Mapping[str, Tensor]) -> dict[str, Any]:
    tensor = inputs.get("sampling_parameters")
    if tensor is None:
        return {}
    try:
        data = jsonio.loads(_text(tensor))
    except jsonio.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise InvalidRequest("input 'sampling_parameters' must hold a JSON object")
    return data


def _streaming(stream: bool | None, route: Route) -> bool:
    if route == "generate_stream":
        # The vLLM backend streams only when asked: without a `stream` input (or with false)
        # it answers once, the prompt prepended unless excluded; Triton sends that as one event.
        return stream is True
    if stream and route == "generate":
        raise InvalidRequest(
            "generate expects model to produce exactly 1 response, use generate stream for model "
            "that generates various number of responses"
        )
    if stream:
        raise InvalidRequest("input 'stream' must be false on infer; use generate_stream to stream")
    return False


def _prefix(prompt: str, exclude: bool | None, streaming: bool) -> str:
    if streaming:
        if exclude is False:
            raise InvalidRequest(
                "When streaming, `exclude_input_in_output` = False is not allowed."
            )
        return ""
    return "" if exclude else prompt


def _model_for(target: Target, lora_name: str | None) -> str:
    model = target.model
    if not lora_name or lora_name in (model.adapter, model.name):
        return model.name
    if model.adapter is not None:
        raise InvalidRequest(
            f"lora_name '{lora_name}' conflicts with model '{model.name}' in the path",
            param="lora_name",
        )
    if lora_name not in target.adapters:
        raise AdapterNotFound(
            f"LoRA {lora_name} is not supported, we currently support {sorted(target.adapters)}",
            param="lora_name",
        )
    return lora_name


def _request(
    target: Target, prompt: Prompt, knobs: Knobs, *, stream: bool, logprobs: int | None
) -> GenerationRequest:
    return GenerationRequest(
        request_id=target.request_id, model=_model_for(target, knobs.lora_name), prompt=prompt,
        sampling=knobs.sampling, output=OutputOptions(logprobs=logprobs), stream=stream,
        protocol="kserve", timeout_s=knobs.timeout_s,
    )


def token_call(
    wire: InferRequest, tensor: Tensor, target: Target, params: Mapping[str, object]
) -> TokenCall:
    """MindIE: sampling knobs live in `inputs[0].parameters`; request parameters also count."""
    ids = _token_ids(tensor, target.vocab_size)
    item_params = {
        k: v for k, v in (wire.inputs[0].parameters or {}).items() if not k.startswith("binary_")
    }
    knobs = to_knobs(
        read_knobs({**params, **item_params}, from_request=True), target.bounds,
        TOKEN_MAX_NEW_TOKENS, target.defaults,
    )
    if knobs.sampling.n != 1:
        raise InvalidRequest("parameter 'n' must be 1 for token ids", param="n")
    return TokenCall(
        request=_request(target, TokenPrompt(ids), knobs, stream=False, logprobs=None),
        output_name=_token_output(wire.outputs),
    )


def _token_ids(tensor: Tensor, vocab_size: int) -> tuple[int, ...]:
    shape = tensor.shape
    rows_ok = len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)
    if not rows_ok or not 0 < shape[-1] <= MAX_TOKEN_IDS:
        raise InvalidRequest(
            "Shape must be at most two-dimensional, and the last element's value must be in "
            f"(0,{MAX_TOKEN_IDS}]."
        )
    ids = tuple(int(v) for v in tensor.data)
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"token id {bad} is out of range for a vocabulary of {vocab_size} tokens"
        )
    return ids


def _token_output(outputs: Sequence[RequestedOutput] | None) -> str:
    if not outputs:
        return "output0"
    if len(outputs) != 1:
        raise InvalidRequest(f"Outputs size should be 1, got {len(outputs)}.")
    return outputs[0].name or "output0"


# ---- the generate extension's body --------------------------------------------------------------
def generate_fields(
    body: object, model: str
) -> tuple[str | None, dict[str, Tensor], dict[str, object]]:
    """(id, input tensors, request parameters) of a generate body.

    As in Triton, every top-level key but `id` and `parameters` names an input tensor; keys that
    are not inputs become request parameters, like the `parameters` object's members.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object")
    client_id = body.get("id")
    if client_id is not None and (not isinstance(client_id, str) or len(client_id) > 256):
        raise InvalidRequest("Unable to parse 'id'")
    nested = body.get("parameters", {})
    if not isinstance(nested, dict):
        raise InvalidRequest("Expected JSON object for keyword: 'parameters'")
    prefix = "Converting keyword: 'parameters': "
    params: dict[str, object] = {k: _parameter(k, v, prefix) for k, v in nested.items()}
    found: list[Tensor] = []
    for key, value in body.items():
        if key in ("id", "parameters"):
            continue
        spec = INPUT_SPECS.get(key)
        if spec is None:
            params[key] = _parameter(key, value, "")
            continue
        dtype = tensors.DATATYPES[spec.datatype]
        count = len(value) if isinstance(value, list) else 1
        found.append(tensors.from_json(key, dtype, (count,), value))
    return client_id or None, check_text_inputs(found, model), params


def _parameter(name: str, value: object, prefix: str) -> object:
    scalar = (str, int, float, bool)
    items = value if isinstance(value, list) else [value]
    if all(isinstance(v, scalar) for v in items):
        return value
    raise InvalidRequest(
        f"{prefix}parameter '{name}' has invalid type. It should be either 'int', 'bool', "
        "'float', 'string' or a list of them."
    )


# ---- MindIE's stopInfer -------------------------------------------------------------------------
def stop_infer_id(raw: bytes) -> tuple[str, object]:
    """(id, decoded body) of a stopInfer body, checked as MindIE does with its messages
    (`SingleReqInferInterfaceBase::Stop`); StopInferInvalid (its 422) otherwise."""
    try:
        body = jsonio.loads(raw)
    except jsonio.JSONDecodeError:
        raise StopInferInvalid("Failed to parse context to json body.") from None
    if not isinstance(body, dict) or "id" not in body:
        raise StopInferInvalid("Not found id.", param="id")
    stop_id = body["id"]
    if stop_id is None:
        raise StopInferInvalid("id must not be null.", param="id")
    if not isinstance(stop_id, str):
        raise StopInferInvalid("id must be string type.", param="id")
    if not re.fullmatch(CLIENT_REQUEST_ID, stop_id):
        raise StopInferInvalid(
            "The id can contain only digits, letters, underscores(_), hyphens(-) and no more than "
            "256 words in length.",
            param="id",
        )
    return stop_id, body


# ---- the response side -------------------------------------------------------------------------
def response_header(model: ModelRef, client_id: str | None) -> dict[str, Any]:
    header: dict[str, Any] = {"id": client_id} if client_id else {}
    header.update(model_name=model.name, model_version=MODEL_VERSION)
    return header


def text_outputs(result: GenerationResult, call: TextCall) -> list[Tensor]:
    """text_output, then the requested extras, as the vLLM backend produces them."""
    columns: dict[str, tuple[str, Callable[[Choice], tensors.TensorValue]]] = {
        "text_output": ("BYTES", lambda c: (call.prefix + c.text).encode()),
        "finish_reason": ("BYTES", lambda c: c.finish_reason.value.encode()),
        "cumulative_logprob": ("FP32", lambda c: _cumulative(c.logprobs)),
        "logprobs": ("BYTES", lambda c: _logprobs_json(c.logprobs, call)),
        "num_output_tokens": ("UINT32", lambda c: len(c.token_ids)),
    }
    produced = []
    for name in ("text_output", *call.extras):
        if name == "num_input_tokens":
            produced.append(Tensor(name, "UINT32", (1,), (result.usage.prompt_tokens,)))
        else:
            dtype, value = columns[name]
            produced.append(
                Tensor(name, dtype, (len(result.choices),), tuple(map(value, result.choices)))
            )
    return produced


def select_outputs(
    produced: Sequence[Tensor], plan: OutputPlan
) -> tuple[list[Tensor], frozenset[str]]:
    """The outputs to send (requested ones in request order) and which go as binary data."""
    if plan.names is None:
        names = frozenset(t.name for t in produced) if plan.binary_default else frozenset()
        return list(produced), names
    by_name = {t.name: t for t in produced}
    return [by_name[name] for name in plan.names if name in by_name], plan.binary


def token_outputs(result: GenerationResult, call: TokenCall) -> list[Tensor]:
    ids = result.choices[0].token_ids if result.choices else ()
    return [Tensor(call.output_name, "UINT32", (1, len(ids)), ids)]


def _cumulative(logprobs: Sequence[TokenLogprob]) -> float:
    return sum(lp.logprob for lp in logprobs)


def _logprobs_json(logprobs: Sequence[TokenLogprob], call: TextCall) -> bytes:
    """The vLLM backend's shape: per token {token_id: {logprob, rank, decoded_token}}."""
    if not call.logprobs_asked:
        return b"null"
    positions = []
    for lp in logprobs:
        rank = next((i for i, t in enumerate(lp.top, 1) if t.token_id == lp.token_id), None)
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": rank, "decoded_token": lp.token}}
        for i, top in enumerate(lp.top, 1):
            entry.setdefault(
                str(top.token_id), {"logprob": top.logprob, "rank": i, "decoded_token": top.token}
            )
        positions.append(entry)
    return jsonio.dumps(positions)


def generate_body(
    result: GenerationResult, call: TextCall, header: Mapping[str, Any]
) -> dict[str, Any]:
    """The generate extension's flattened object: one key per output (1 element → scalar)."""
    body = dict(header)
    for tensor in text_outputs(result, call):
        values = tensors.to_json_data(tensor)
        body[tensor.name] = values[0] if len(values) == 1 else values
    if call.details and result.choices:
        choice = result.choices[0]
        body["details"] = _details(choice.finish_reason.value, len(choice.token_ids))
    return body


def _text_output_head(header: Mapping[str, Any]) -> bytes:
    """`{<header fields>,"text_output":` as `jsonio.dumps` writes the event's start."""
    if not header:
        return b'{"text_output":'
    return jsonio.dumps(header)[:-1] + b',"text_output":'


def _details(reason: str, generated: int) -> dict[str, Any]:
    """MindIE's `details` (timings are not measured per request here)."""
    return {"finish_reason": reason, "generated_tokens": generated,
            "first_token_cost": None, "decode_cost": None}


class StreamFolder:
    """Engine events → `generate_stream` event objects.

    One event per engine delta with the delta `text_output` and `"done": false`; the choice's
    last delta carries `"done": true` and, when asked, `finish_reason` (the vLLM backend's last
    response carries both too). `done` is KServe's generate spec; Triton clients ignore it. If the
    stream ends without a finishing delta (an engine that never says), a last event with an empty
    `text_output` closes it.
    """

    def __init__(self, call: TextCall, header: Mapping[str, Any]) -> None:
        self._call = call
        self._header = dict(header)
        self._prompt_tokens = 0
        self._generated = 0
        self._cumulative = 0.0
        self._reason = "abort"
        self._finished = False
        # the bytes before `text_output`'s value when a delta that ends nothing has no extras
        plain = all(name == "finish_reason" for name in call.extras) and not (
            {"text_output", "done"} & self._header.keys()
        )
        self._plain_head = _text_output_head(self._header) if plain else None

    def plain_frame(self, delta: Delta, head: bytes, tail: bytes) -> bytes | None:
        """The serialised event of a delta that ends nothing, when no extra output goes on it
        (most events of a stream), between `head` and `tail`; byte for byte what `fold` gives
        serialised. None for any other delta, or an empty one."""
        prefix = self._plain_head
        if prefix is None or delta.finish is not None or not (delta.text or delta.token_ids):
            return None
        self._finished = False
        self._generated += len(delta.token_ids)
        if delta.logprobs:
            self._cumulative += _cumulative(delta.logprobs)
        return b"".join((head, prefix, jsonio.dumps_scalar(delta.text), b',"done":false}', tail))

    def fold(self, event: GenerationEvent) -> dict[str, Any] | None:
        if isinstance(event, Delta):
            if event.finish is not None:
                self._reason = event.finish.value
                return self._delta(event, done=True)
            if event.text or event.token_ids:
                return self._delta(event, done=False)
            return None
        if isinstance(event, Started):
            self._prompt_tokens = len(event.prompt_token_ids)
            return None
        return self.close()

    def _extra(self, name: str, delta: Delta) -> Any:
        if name == "finish_reason":
            return self._reason
        if name == "cumulative_logprob":
            return self._cumulative
        if name == "logprobs":
            return _logprobs_json(delta.logprobs, self._call).decode()
        if name == "num_input_tokens":
            return self._prompt_tokens
        return len(delta.token_ids)  # num_output_tokens

    def close(self) -> dict[str, Any] | None:
        """The closing event, unless the last delta already carried `done`."""
        if self._finished:
            return None
        return self._delta(Delta(choice=0, text=""), done=True)

    def _delta(self, delta: Delta, *, done: bool) -> dict[str, Any]:
        self._finished = done
        self._generated += len(delta.token_ids)
        if delta.logprobs:
            self._cumulative += _cumulative(delta.logprobs)
        event = {**self._header, "text_output": delta.text}
        for name in self._call.extras:  # usually none: computed only when asked for
            if done or name != "finish_reason":
                event[name] = self._extra(name, delta)
        if done and self._call.details:
            event["details"] = _details(self._reason, self._generated)
        event["done"] = done
        return event
