"""TGI translation, pure: a parsed body → a validated `Plan` → `GenerationRequest`; results and
events → TGI's JSON shapes (`/generate` object, `POST /` list, `/generate_stream` events,
`/tokenize`, `/info`).

Validation follows TGI's router (`validation.rs`): same order, same bounds, same messages, so a
client sees what TGI would say; `grammar` gets the router's checks too (draft 2020-12
meta-validation, `properties` required). Two deliberate differences: an unknown `adapter_id` is an
error (TGI silently uses the base model, issue #2505), and `watermark` is refused (422) since the
engine cannot honour it. `typical_p` is the one knob validated and then not applied (vLLM has no
typical sampling): refusing it would refuse every request of LangChain's `HuggingFaceEndpoint`,
which sends 0.95 by default (docs/protocols.md lists it).

Model defaults (the model's `generation_config.json`): a field the request leaves out takes the
model's value instead of TGI's neutral one; a greedy request keeps temperature 0, and an omitted
`max_new_tokens` is the model's limit within the room the prompt leaves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from protocols.common import grammar
from protocols.tgi.schema import GenerateRequest, Parameters
from server.core.budget import Ask, BudgetPolicy, BudgetWords, Overflow
from server.core.composition import merge_from_wire
from server.core.errors import GatewayError, InvalidRequest, Unsupported
from server.core.frozen import quick_init
from server.core.sampling import omitted_fields, with_model_defaults
from server.core.types import (
    AdapterMerge,
    Choice,
    Delta,
    EngineInfo,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    OutputOptions,
    Sampling,
    SamplingDefaults,
    Started,
    TextPrompt,
    TokenLogprob,
)
from server.http import jsonio
from server.http.context import RequestBounds
from server.http.streaming import token_pieces

# TGI launcher defaults (--max-best-of, --max-stop-sequences, --max-top-n-tokens).
TGI_MAX_BEST_OF = 2
TGI_MAX_STOP_SEQUENCES = 4
TGI_MAX_TOP_N_TOKENS = 5
TGI_GENERATION_CHUNK = 1024  # validation.rs DEFAULT_GENERATION_LENGTH: what the check counts
NO_DEFAULTS = SamplingDefaults()
DEFAULTED = ("temperature", "top_p", "top_k", "repetition_penalty", "frequency_penalty")


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    max_input_tokens: int
    max_total_tokens: int
    max_best_of: int = TGI_MAX_BEST_OF
    max_stop_sequences: int = TGI_MAX_STOP_SEQUENCES
    max_top_n_tokens: int = TGI_MAX_TOP_N_TOKENS
    max_stop_length: int = 1024

    @classmethod
    def of(cls, bounds: RequestBounds, max_model_len: int) -> Limits:
        """TGI's defaults, never looser than the server-wide bounds."""
        return cls(
            max_input_tokens=max_model_len - 1,
            max_total_tokens=max_model_len,
            max_best_of=min(TGI_MAX_BEST_OF, bounds.max_best_of),
            max_stop_sequences=min(TGI_MAX_STOP_SEQUENCES, bounds.max_stop_sequences),
            max_top_n_tokens=min(TGI_MAX_TOP_N_TOKENS, bounds.max_top_n_tokens),
            max_stop_length=bounds.max_stop_length,
        )


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A validated TGI request, before its prompt is tokenized."""

    inputs: str
    adapter: str
    sampling: Sampling
    output: OutputOptions
    details: bool
    prefill: bool  # decoder_input_details
    full_text: bool
    best_of: int
    top_n: int
    seed: int | None
    stream: bool
    merge: AdapterMerge | None = None  # LoRAX's `merged_adapters`


def invalid(message: str, field: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=f"parameters.{field}" if field else "inputs")


class TgiBudgetWords(BudgetWords):
    """TGI's router (`validation.rs`, `validate_input`): the prompt plus `min(max_new_tokens,
    1024)` must fit `max_total_tokens` (the context; its message names that smaller number),
    and the prompt must be shorter than `max_input_tokens` (the context less one)."""

    def prompt_too_long(self, ask: Ask) -> GatewayError:
        return self.too_many_new_tokens(ask)

    def no_room(self, ask: Ask) -> GatewayError:
        if ask.new_tokens:
            return self.too_many_new_tokens(ask)
        return invalid(
            f"`inputs` must have less than {ask.context - 1} tokens. Given: {ask.prompt_tokens}"
        )

    def too_many_new_tokens(self, ask: Ask) -> GatewayError:
        return invalid(
            f"`inputs` tokens + `max_new_tokens` must be <= {ask.context}. "
            f"Given: {ask.prompt_tokens} `inputs` tokens and {ask.new_tokens} `max_new_tokens`",
            "max_new_tokens",
        )


# TGI refuses a limit the prompt leaves no room for, counting at most one 1024-token round; it
# then generates in such rounds while the context has room: here a larger `max_new_tokens` that
# passed the check generates until the context is full.
TGI_BUDGET = BudgetPolicy(
    overflow=Overflow.REFUSE, counted=TGI_GENERATION_CHUNK, words=TgiBudgetWords()
)


def plan(
    body: GenerateRequest,
    limits: Limits,
    *,
    stream: bool,
    defaults: SamplingDefaults = NO_DEFAULTS,
    full_text: bool = False,
    adapter: str | None = None,
) -> Plan:
    """Validate the parameters (TGI's checks that need no tokenizer) and decide the sampling;
    what the request leaves out takes the model's `defaults`. `full_text` is what an omitted
    `return_full_text` means: false on `/generate*`; on `POST /` (and SageMaker's
    `/invocations`) TGI's pipeline default, true for a text-generation model (`server.rs`).
    `adapter` (what DJL's selectors name on SageMaker's `/invocations`; "" = base) wins over
    `parameters.adapter_id`."""
    p = body.parameters if body.parameters is not None else Parameters(do_sample=True)
    best_of = 1 if p.best_of is None else p.best_of
    sampling = _sampling_wanted(p)
    _check_stream_only(p, best_of, stream)
    _check_best_of(p, best_of, sampling, limits)
    _check_knobs(p)
    _check_lengths(body, p, limits)
    _check_unsupported(p)
    merge = _merge(p)
    top_n = p.top_n_tokens or 0
    details = bool(p.details or p.decoder_input_details)
    wants_logprobs = top_n > 0 or details or best_of > 1
    return Plan(
        inputs=body.inputs,
        adapter=(p.adapter_id or "") if adapter is None else adapter,
        sampling=with_model_defaults(
            _to_sampling(p, sampling, best_of), defaults, omitted_fields(p, DEFAULTED),
            greedy=not sampling,
        ),
        output=OutputOptions(
            logprobs=top_n if wants_logprobs else None,
            prompt_logprobs=0 if p.decoder_input_details else None,
        ),
        details=details,
        prefill=bool(p.decoder_input_details),
        full_text=full_text if p.return_full_text is None else p.return_full_text,
        best_of=best_of,
        top_n=top_n,
        seed=p.seed,
        stream=stream,
        merge=merge,
    )


def _merge(p: Parameters) -> AdapterMerge | None:
    """LoRAX's `merged_adapters`: adapters composed for this request, never with `adapter_id`."""
    if p.merged_adapters is None:
        return None
    if p.adapter_id:
        raise invalid("at most one of `adapter_id` or `adapters` may be provided", "adapter_id")
    return merge_from_wire(p.merged_adapters, param="parameters.merged_adapters")


def _sampling_wanted(p: Parameters) -> bool:
    """TGI samples when asked to, or when any warper differs from its neutral value."""
    return bool(
        p.do_sample
        or (p.temperature is not None and p.temperature != 1.0)
        or (p.top_k is not None and p.top_k != 0)
        or (p.top_p is not None and p.top_p < 1.0)
        or (p.typical_p is not None and p.typical_p < 1.0)
    )


def _check_stream_only(p: Parameters, best_of: int, stream: bool) -> None:
    if not stream:
        return
    if best_of != 1:
        raise invalid("`best_of` != 1 is not supported when streaming tokens", "best_of")
    if p.decoder_input_details:
        raise invalid(
            "`decoder_input_details` == true is not supported when streaming tokens",
            "decoder_input_details",
        )


def _check_best_of(p: Parameters, best_of: int, sampling: bool, limits: Limits) -> None:
    if best_of == 0 or best_of > limits.max_best_of:
        raise invalid(
            f"`best_of` must be > 0 and <= {limits.max_best_of}. Given: {best_of}", "best_of"
        )
    if best_of > 1 and not sampling:
        raise invalid("you must use sampling when `best_of` is > 1", "best_of")
    if best_of > 1 and p.seed is not None:
        raise invalid("`seed` must not be set when `best_of` > 1", "seed")


def _check_knobs(p: Parameters) -> None:
    if p.temperature is not None and p.temperature <= 0.0:
        raise invalid("`temperature` must be strictly positive", "temperature")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0.0:
        raise invalid("`repetition_penalty` must be strictly positive", "repetition_penalty")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise invalid("`frequency_penalty` must be >= -2.0 and <= 2.0", "frequency_penalty")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise invalid("`top_p` must be > 0.0 and < 1.0", "top_p")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise invalid("`typical_p` must be > 0.0 and < 1.0", "typical_p")
    if p.top_k is not None and p.top_k <= 0:
        raise invalid("`top_k` must be strictly positive", "top_k")
    if p.max_new_tokens == 0:
        raise invalid("`max_new_tokens` must be strictly positive", "max_new_tokens")


def _check_lengths(body: GenerateRequest, p: Parameters, limits: Limits) -> None:
    stop = p.stop or []
    if len(stop) > limits.max_stop_sequences:
        raise invalid(
            f"`stop` supports up to {limits.max_stop_sequences} stop sequences. Given: {len(stop)}",
            "stop",
        )
    if any(not s or len(s) > limits.max_stop_length for s in stop):
        raise invalid(
            f"each `stop` sequence must have 1 to {limits.max_stop_length} characters", "stop"
        )
    if p.top_n_tokens is not None and p.top_n_tokens > limits.max_top_n_tokens:
        raise invalid(
            f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. "
            f"Given: {p.top_n_tokens}",
            "top_n_tokens",
        )
    if not body.inputs:
        raise invalid("`inputs` cannot be empty")
    if p.truncate is not None and not 0 < p.truncate <= limits.max_input_tokens:
        raise invalid(
            f"`truncate` must be strictly positive and less than {limits.max_input_tokens}. "
            f"Given: {p.truncate}",
            "truncate",
        )


def _check_unsupported(p: Parameters) -> None:
    if p.watermark:
        raise Unsupported(
            "`watermark` is not supported by this server", param="parameters.watermark"
        )


def _to_sampling(p: Parameters, sampling: bool, best_of: int) -> Sampling:
    return Sampling(
        max_new_tokens=p.max_new_tokens,
        truncate_prompt_tokens=p.truncate,
        budget=TGI_BUDGET,
        temperature=(p.temperature or 1.0) if sampling else 0.0,
        top_p=(p.top_p or 1.0) if sampling else 1.0,
        top_k=(p.top_k or 0) if sampling else 0,
        seed=p.seed,
        repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        n=best_of,
        stop=tuple(p.stop or ()),
        include_stop_str_in_output=True,  # TGI's text ends with the stop sequence it matched
        structured=None if p.grammar is None else grammar.to_structured(
            p.grammar, field="grammar", param="parameters.grammar"
        ),
    )


def to_generation_request(plan: Plan, *, request_id: str) -> GenerationRequest:
    """The request as planned; the engine fits its tokenized prompt by `TGI_BUDGET`."""
    return GenerationRequest(
        request_id=request_id,
        model=plan.adapter,
        prompt=TextPrompt(plan.inputs),
        sampling=plan.sampling,
        output=plan.output,
        stream=plan.stream,
        protocol="tgi",
        merge=plan.merge,
    )


# ---- responses -----------------------------------------------------------------------------


def finish_reason(reason: FinishReason, matched_stop: str | int | None) -> str:
    """TGI's reasons. An aborted generation reads as a stop, as in MindIE's TGI routes."""
    if reason is FinishReason.LENGTH:
        return "length"
    if reason is FinishReason.ABORT or isinstance(matched_stop, str):
        return "stop_sequence"
    return "eos_token"


def token(
    token_id: int, text: str, logprob: float | None, eos_token_id: int | None
) -> dict[str, Any]:
    return {"id": token_id, "text": text, "logprob": logprob, "special": token_id == eos_token_id}


def _top(entry: TokenLogprob, eos_token_id: int | None) -> list[dict[str, Any]]:
    return [token(t.token_id, t.token, t.logprob, eos_token_id) for t in entry.top]


def _tokens(choice: Choice, eos_token_id: int | None) -> list[dict[str, Any]]:
    logprobs = choice.logprobs
    out = []
    for i, token_id in enumerate(choice.token_ids):
        entry = logprobs[i] if i < len(logprobs) else None
        out.append(
            token(
                token_id,
                entry.token if entry else "",
                entry.logprob if entry else None,
                eos_token_id,
            )
        )
    return out


def prefill(started: Started, texts: Sequence[str]) -> list[dict[str, Any]]:
    """Prompt tokens with their logprobs (the first has none)."""
    logprobs = started.prompt_logprobs
    out = []
    for i, token_id in enumerate(started.prompt_token_ids):
        entry = logprobs[i] if i < len(logprobs) else None
        text = texts[i] if i < len(texts) else (entry.token if entry else "")
        out.append({"id": token_id, "text": text, "logprob": entry.logprob if entry else None})
    return out


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Rendering:
    """What the response needs besides the result: the plan, EOS id and prompt token texts."""

    plan: Plan
    eos_token_id: int | None
    prefill_texts: Sequence[str] = ()


def _sequence(choice: Choice, result: GenerationResult, r: Rendering) -> dict[str, Any]:
    out: dict[str, Any] = {
        "generated_text": _text(choice.text, r.plan),
        "finish_reason": finish_reason(choice.finish_reason, choice.matched_stop),
        "generated_tokens": len(choice.token_ids),
        "seed": r.plan.seed,
        "prefill": prefill(result.prompt, r.prefill_texts) if r.plan.prefill else [],
        "tokens": _tokens(choice, r.eos_token_id),
    }
    if r.plan.top_n:
        out["top_tokens"] = [_top(entry, r.eos_token_id) for entry in choice.logprobs]
    return out


def _text(text: str, plan: Plan) -> str:
    return plan.inputs + text if plan.full_text else text


def _mean_logprob(choice: Choice) -> float:
    values = [lp.logprob for lp in choice.logprobs if math.isfinite(lp.logprob)]
    return sum(values) / len(values) if values else -math.inf


def best_first(choices: Sequence[Choice]) -> list[Choice]:
    """TGI's best_of: the sequence with the highest mean token logprob, then the others in order."""
    best = max(range(len(choices)), key=lambda i: _mean_logprob(choices[i]))
    return [choices[best], *(c for i, c in enumerate(choices) if i != best)]


def to_generate_response(result: GenerationResult, r: Rendering) -> dict[str, Any]:
    """The `/generate` object (`POST /` wraps it in a one-element list)."""
    choices = best_first(result.choices)
    best = choices[0]
    body: dict[str, Any] = {"generated_text": _text(best.text, r.plan)}
    if r.plan.details:
        sequence = _sequence(best, result, r)
        del sequence["generated_text"]
        top_tokens = sequence.pop("top_tokens", None)
        details: dict[str, Any] = sequence
        if len(choices) > 1:
            details["best_of_sequences"] = [_sequence(c, result, r) for c in choices[1:]]
        if top_tokens:
            details["top_tokens"] = top_tokens
        body["details"] = details
    return body


_SPECIAL = b',"special":true},"generated_text":null,"details":null}'
_NOT_SPECIAL = b',"special":false},"generated_text":null,"details":null}'


class StreamEncoder:
    """Turns one choice's deltas into `/generate_stream` events (dicts; the caller frames them).

    One event per token; the event of the last token also carries `generated_text` and, with
    `details`, the stream details. Token texts always join to `generated_text` (see
    `token_pieces` for deltas that hold several tokens).
    """

    def __init__(
        self, r: Rendering, *, input_length: int, token_texts: Callable[[list[int]], list[str]]
    ) -> None:
        self._r = r
        self._token_texts = token_texts
        self._input_length = input_length
        self._index = 0
        self._generated = 0
        self._parts: list[str] = []

    def events(self, delta: Delta) -> list[dict[str, Any]]:
        ids = delta.token_ids
        end = delta if delta.finish is not None else None
        if not ids:
            self._parts.append(delta.text)
            return [self.final(end)] if end is not None else []
        last = len(ids) - 1
        logprobs = delta.logprobs
        pieces = token_pieces(delta, self._token_texts)
        return [
            self._event(
                token_id,
                pieces[i],
                logprobs[i] if i < len(logprobs) else None,
                end if i == last else None,
            )
            for i, token_id in enumerate(ids)
        ]

    def plain_frame(self, delta: Delta, head: bytes, tail: bytes) -> bytes | None:
        """The serialised event of a one-token delta that ends nothing and carries no top
        tokens (most events of a stream), without building its dict, between `head` and `tail`
        (the stream's framing) in one join; byte for byte what `events` gives serialised.
        None for any other delta."""
        if delta.finish is not None or len(delta.token_ids) != 1:
            return None
        logprobs = delta.logprobs
        if not logprobs:
            logprob = b"null"
        elif self._r.plan.top_n:
            return None
        else:
            logprob = jsonio.dumps_scalar(logprobs[0].logprob)
        token_id = delta.token_ids[0]
        self._index += 1
        self._generated += 1
        self._parts.append(delta.text)
        return b"".join((
            head, b'{"index":', str(self._index).encode(), b',"token":{"id":',
            str(token_id).encode(), b',"text":', jsonio.dumps_scalar(delta.text),
            b',"logprob":', logprob,
            _SPECIAL if token_id == self._r.eos_token_id else _NOT_SPECIAL, tail,
        ))

    def final(self, end: Delta) -> dict[str, Any]:
        """An end that came without a token of its own (an abort, a stop string)."""
        eos = self._r.eos_token_id
        event = self._event(eos if eos is not None else 0, "", None, end, generated=False)
        event["token"]["special"] = True
        return event

    def _event(
        self,
        token_id: int,
        text: str,
        entry: TokenLogprob | None,
        end: Delta | None,
        *,
        generated: bool = True,
    ) -> dict[str, Any]:
        self._index += 1
        self._generated += generated
        self._parts.append(text)
        event: dict[str, Any] = {
            "index": self._index,
            "token": token(token_id, text, entry.logprob if entry else None, self._r.eos_token_id),
        }
        if self._r.plan.top_n and entry is not None:
            event["top_tokens"] = _top(entry, self._r.eos_token_id)
        event["generated_text"] = None
        event["details"] = None
        if end is not None and end.finish is not None:
            event["generated_text"] = _text("".join(self._parts), self._r.plan)
            if self._r.plan.details:
                event["details"] = {
                    "finish_reason": finish_reason(end.finish, end.matched_stop),
                    "generated_tokens": self._generated,
                    "seed": self._r.plan.seed,
                    "input_length": self._input_length,
                }
        return event


# ---- tokenize and info -----------------------------------------------------------------------


def to_tokenize_response(
    inputs: str, token_ids: Sequence[int], texts: Sequence[str]
) -> list[dict[str, Any]]:
    """TGI's `SimpleToken`s: id, the input substring it covers and its byte offsets.

    Offsets come from matching each token's text in the input, in order. A token whose text is
    not there (a special token, or one byte of a multi-byte character) covers the gap before the
    next token that is found, or nothing.
    """
    spans = _spans(inputs, texts)
    out = []
    for token_id, (start, stop) in zip(token_ids, spans, strict=True):
        piece = inputs[start:stop]
        byte_start = len(inputs[:start].encode())
        out.append(
            {
                "id": token_id,
                "text": piece,
                "start": byte_start,
                "stop": byte_start + len(piece.encode()),
            }
        )
    return out


def _spans(inputs: str, texts: Sequence[str]) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    cursor = 0
    pending: list[int] = []
    for text in texts:
        found = inputs.find(text, cursor) if text else -1
        if found < 0:
            pending.append(len(spans))
            spans.append((cursor, cursor))
            continue
        for index in pending:
            spans[index] = (cursor, found)
        pending = []
        spans.append((found, found + len(text)))
        cursor = found + len(text)
    for index in pending:
        spans[index] = (cursor, len(inputs)) if cursor < len(inputs) else (cursor, cursor)
    return spans


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerFacts:
    served_name: str
    version: str
    max_concurrent_requests: int
    max_client_batch_size: int
    kv_cache_tokens: int


def to_info(info: EngineInfo, limits: Limits, facts: ServerFacts) -> dict[str, Any]:
    """TGI's `/info` fields plus MindIE's extra ones (`models`, `max_batch_total_tokens`, ...)."""
    return {
        "model_id": facts.served_name,
        "model_sha": None,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": facts.max_concurrent_requests,
        "max_best_of": limits.max_best_of,
        "max_stop_sequences": limits.max_stop_sequences,
        "max_input_tokens": limits.max_input_tokens,
        "max_total_tokens": limits.max_total_tokens,
        "validation_workers": 1,
        "max_client_batch_size": facts.max_client_batch_size,
        "router": "llm-gateway",
        "version": facts.version,
        "sha": None,
        "docker_label": None,
        "max_input_length": limits.max_input_tokens,
        "max_batch_total_tokens": facts.kv_cache_tokens,
        "max_waiting_tokens": None,
        "waiting_served_ratio": None,
        "models": [
            {
                "model_id": facts.served_name,
                "model_sha": None,
                "model_pipeline_tag": "text-generation",
                "model_dtype": info.dtype,
                "model_device_type": None,  # the engine does not say which device it runs on
                "max_total_tokens": limits.max_total_tokens,
                "engine": "vllm",
                "engine_version": info.version,
            }
        ],
    }
