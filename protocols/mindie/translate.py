"""MindIE native translation, pure: `/infer`, `/infer_token`, the vLLM flavour of `/generate` and
`/v1/tokenizer` bodies → `GenerationRequest`; results and events → MindIE's JSON shapes.

Bounds and messages follow MindIE's `infer_param.cpp` and `single_req_*_infer_interface.cpp`.
A key those handlers do not read is ignored, as MindIE ignores it (schema.py), and never reaches
the engine: no logprobs of any kind are asked from it on these routes.
Accepted but without effect here: `priority` (validated 1-5; a scheduling hint, and vLLM's
default FCFS scheduler refuses per-request priorities). `watermark: true` and `typical_p` below
1.0 are refused (vLLM has neither). `seed` is reported only when the client gave one (MindIE
draws and reports a random one).

Model defaults (the model's `generation_config.json`): a sampling field or output limit the request
leaves out takes the model's value instead of MindIE's; a greedy `/infer` request (MindIE's
`do_sample` rule) keeps temperature 0 but takes the model's repetition penalty and limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from protocols.common.budget import VLLM_REFUSES
from protocols.mindie.schema import InferParameters, InferRequest, VllmGenerateRequest
from server.core.errors import InvalidRequest, Unsupported
from server.core.frozen import quick_init
from server.core.sampling import omitted_fields, with_model_defaults
from server.core.types import (
    Delta,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Prompt,
    Sampling,
    SamplingDefaults,
    TextPrompt,
    TokenPrompt,
)
from server.http import jsonio
from server.http.context import RequestBounds
from server.http.streaming import token_pieces

MAX_TOKEN_ID = 1024 * 1024  # MindIE: each input_id in [0, 1048576], at most that many
MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1
MAX_FLOAT = 3.4028234663852886e38
MAX_PRIORITY = 5
MAX_TIMEOUT_S = 65535
INFER_DEFAULT_MAX_NEW_TOKENS = 20
VLLM_DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default, which its legacy /generate used
MAX_N = 128
MAX_TOTAL_STOP = 32 * 1024  # MindIE: the stop strings of one request, in all
NO_DEFAULTS = SamplingDefaults()
INFER_DEFAULTED = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens")
VLLM_DEFAULTED = ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")


def invalid(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


# ---- /infer and /infer_token ---------------------------------------------------------------------


def infer_prompt(body: dict[str, Any]) -> Prompt:
    """The prompt of `/infer` or `/infer_token`: text `inputs` or token `input_id`, never both."""
    if "inputs" in body and "input_id" in body:
        raise invalid("Input conflict.", "inputs")
    if "inputs" in body:
        return TextPrompt(_text_input(body["inputs"], "Inputs", "inputs"))
    if "input_id" in body:
        return TokenPrompt(_token_input(body["input_id"]))
    raise invalid("Not found inputs.", "inputs")


def _text_input(value: Any, name: str, param: str) -> str:
    if value is None:
        raise invalid(f"{name} must not be null", param)
    if isinstance(value, list):
        value = multimodal_text(value, name, param)
    if not isinstance(value, str):
        raise invalid(f"The type of {name.lower()} is abnormal", param)
    if not value:
        raise invalid(
            f"{name} must be necessary and data type must be string and length in (0, "
            f"{MAX_TOKEN_ID}], but the length of {name.lower()} is 0",
            param,
        )
    return value


def multimodal_text(items: list[Any], name: str, param: str) -> str:
    """MindIE's multimodal list; only its text items can be served by this gateway."""
    if not items:
        raise invalid(f"{name} arr is empty", param)
    texts = []
    for item in items:
        if not isinstance(item, dict) or item.get("type", "text") != "text" or "text" not in item:
            raise Unsupported("Only text items are supported in multimodal inputs", param=param)
        if not isinstance(item["text"], str):
            raise invalid("Request param text must be string", param)
        texts.append(item["text"])
    return "".join(texts)


def _token_input(value: Any) -> tuple[int, ...]:
    if value is None:
        raise invalid("Input_id should not be empty", "input_id")
    if not isinstance(value, list):
        raise invalid("Parameter input_id must be an array", "input_id")
    for token_id in value:
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise invalid("Parameter input_id must be integer", "input_id")
        if not 0 <= token_id <= MAX_TOKEN_ID:
            raise invalid("Data element in param input_id is invalid", "input_id")
    if not value or len(value) > MAX_TOKEN_ID:
        raise invalid(
            f"Inputs token length must be in (0, {MAX_TOKEN_ID}], but got {len(value)}", "input_id"
        )
    return tuple(value)


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class InferPlan:
    request: GenerationRequest
    details: bool
    seed: int | None


def infer_request(
    body: InferRequest, prompt: Prompt, *, request_id: str,
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> InferPlan:
    p = body.parameters or InferParameters()
    _check_infer_parameters(p)
    sample = bool(
        p.do_sample
        or (p.do_sample is None and (p.temperature, p.top_k, p.top_p) != (None, None, None))
    )
    sampling = Sampling(
        max_new_tokens=(
            INFER_DEFAULT_MAX_NEW_TOKENS if p.max_new_tokens is None else p.max_new_tokens
        ),
        temperature=(p.temperature or 1.0) if sample else 0.0,
        top_p=(p.top_p or 1.0) if sample else 1.0,
        top_k=(p.top_k or 0) if sample else 0,
        seed=p.seed,
        repetition_penalty=p.repetition_penalty or 1.0,
        budget=VLLM_REFUSES,
    )
    sampling = with_model_defaults(
        sampling, defaults, omitted_fields(p, INFER_DEFAULTED), greedy=not sample
    )
    request = GenerationRequest(
        request_id=request_id, model="", prompt=prompt, sampling=sampling,
        stream=bool(body.stream), protocol="mindie", timeout_s=p.timeout,
    )
    return InferPlan(request=request, details=bool(p.details), seed=p.seed)


def _check_infer_parameters(p: InferParameters) -> None:
    _check_sampling(p.temperature, p.top_k, p.top_p, p.repetition_penalty)
    if p.typical_p is not None and not 0.0 < p.typical_p <= 1.0:
        raise invalid(f"Parameter typical_p must be in (0.0,1.0], got {p.typical_p}.", "typical_p")
    if p.typical_p is not None and p.typical_p < 1.0:
        raise Unsupported(
            "Parameter typical_p below 1.0 is not supported by this server", param="typical_p"
        )
    if p.seed is not None and p.seed > MAX_INT64:
        raise invalid(f"Parameter seed must be in [0, {MAX_INT64}], got {p.seed}.", "seed")
    if p.priority is not None and not 1 <= p.priority <= MAX_PRIORITY:
        raise invalid(
            f"Parameter priority must be in [1,{MAX_PRIORITY}], got {p.priority}.", "priority"
        )
    if p.max_new_tokens is not None and not 0 < p.max_new_tokens <= MAX_INT32:
        raise invalid(
            f"Parameter max_new_tokens must be in (0,{MAX_INT32}], got {p.max_new_tokens}.",
            "max_new_tokens",
        )
    if p.timeout is not None and not 0 < p.timeout <= MAX_TIMEOUT_S:
        raise invalid(
            "Parameter timeout must be strictly positive and small than 65535 seconds, got "
            f"{p.timeout}.",
            "timeout",
        )
    if p.watermark:
        raise Unsupported("Parameter watermark is not supported by this server", param="watermark")


def _check_sampling(
    temperature: float | None, top_k: int | None, top_p: float | None,
    repetition_penalty: float | None, *, greedy_ok: bool = False,
) -> None:
    """MindIE's bounds; the vLLM flavour (`greedy_ok`) also takes temperature 0, top_k -1 and
    top_p 1."""
    # MindIE words the temperature and top_p bounds alike on both routes (`AssignTemperature`,
    # `AssignTopP`), whichever end the route takes.
    lowest = 0.0 if greedy_ok else math.nextafter(0.0, 1.0)
    if temperature is not None and not lowest <= temperature <= MAX_FLOAT:
        raise invalid(
            f"Parameter temperature must be in (0.0,{MAX_FLOAT:g}], got {temperature}.",
            "temperature",
        )
    if top_k is not None and not (0 < top_k <= MAX_INT32 or (greedy_ok and top_k == -1)):
        raise invalid(f"Parameter top_k must be in -1 || (0,{MAX_INT32}], got {top_k}", "top_k")
    if top_p is not None and not (0.0 < top_p < 1.0 or (greedy_ok and top_p == 1.0)):
        raise invalid(f"Parameter top_p must be in (0.0,1.0], got {top_p}.", "top_p")
    if repetition_penalty is not None and not 0.0 < repetition_penalty <= MAX_FLOAT:
        raise invalid(
            f"Parameter 'repetition_penalty' must be in (0.0, {MAX_FLOAT:g}], got "
            f"{repetition_penalty}.",
            "repetition_penalty",
        )


def finish_reason(reason: FinishReason, matched_stop: str | int | None) -> str:
    """MindIE's reasons (`GetFinishReasonStr`): aborted requests read as `stop_sequence`."""
    if reason is FinishReason.LENGTH:
        return "length"
    if reason is FinishReason.ABORT or isinstance(matched_stop, str):
        return "stop_sequence"
    return "eos_token"


def to_infer_response(result: GenerationResult, plan: InferPlan) -> dict[str, Any]:
    choice = result.choices[0]
    body: dict[str, Any] = {"generated_text": choice.text}
    if plan.details:
        body["details"] = {
            "finish_reason": finish_reason(choice.finish_reason, choice.matched_stop),
            "generated_tokens": len(choice.token_ids),
            "generated_token_ids": list(choice.token_ids),
            "seed": plan.seed,
        }
    return body


_PREFILL = b'{"prefill_time":'
_NO_DECODE = b',"decode_time":null'
_DECODE = b'{"prefill_time":null,"decode_time":'
_DOT = ord(".")


class InferStreamEncoder:
    """`/infer` stream events: one per token with `prefill_time` (first) or `decode_time` (ms);
    the last token's event instead carries `generated_text`, `details` and a null token text."""

    def __init__(
        self, plan: InferPlan, *, started_at: float,
        token_texts: Callable[[list[int]], list[str]],
    ) -> None:
        self._plan = plan
        self._token_texts = token_texts
        self._last_at = started_at
        self._count = 0
        self._parts: list[str] = []
        self._last_id = 0

    def plain_frame(self, delta: Delta, now: float, head: bytes, tail: bytes) -> bytes | None:
        """The serialised event of a one-token delta that ends nothing (most events of a
        stream), without building its dict, between `head` and `tail` (the stream's framing)
        in one join; byte for byte what `events` gives serialised. None for any other delta."""
        elapsed = (now - self._last_at) * 1000.0
        if delta.finish is not None or len(delta.token_ids) != 1 or not 0 <= elapsed < 1e9:
            return None
        token_id = delta.token_ids[0]
        self._parts.append(delta.text)
        # round(elapsed, 3) as JSON, for less: `.3f` rounds the same, and below 1e9 (11 days)
        # the shortest form of the rounded value is those digits without trailing zeros
        ms = (b"%.3f" % elapsed).rstrip(b"0")
        if ms[-1] == _DOT:
            ms += b"0"
        self._last_at = now
        self._last_id = token_id
        first = self._count == 0
        self._count += 1
        return b"".join((
            head, _PREFILL if first else _DECODE, ms, _NO_DECODE if first else b"",
            b',"token":{"id":', str(token_id).encode(), b',"text":',
            jsonio.dumps_scalar(delta.text), b"}}", tail,
        ))

    def events(self, delta: Delta, now: float) -> list[dict[str, Any]]:
        ids = delta.token_ids
        end = delta if delta.finish is not None else None
        if not ids and end is not None and not delta.text:
            return [self.final(end, now)]
        self._parts.append(delta.text)
        elapsed = (now - self._last_at) * 1000.0 / max(len(ids), 1)
        self._last_at = now
        pieces = token_pieces(delta, self._token_texts)
        out = []
        for i, token_id in enumerate(ids):
            self._last_id = token_id
            if end is not None and i == len(ids) - 1:
                out.append(self._final(end, elapsed))
            else:
                out.append(self._timed(elapsed) | {"token": {"id": token_id, "text": pieces[i]}})
        if not ids and end is not None:
            out.append(self._final(end, elapsed))
        return out

    def final(self, end: Delta, now: float) -> dict[str, Any]:
        """An end without a token of its own: the final event names the last token again."""
        elapsed = (now - self._last_at) * 1000.0
        return self._final(end, elapsed, counted=False)

    def _timed(self, elapsed_ms: float, *, counted: bool = True) -> dict[str, Any]:
        first = self._count == 0
        if counted:
            self._count += 1
        ms = round(elapsed_ms, 3)
        return {"prefill_time": ms if first else None, "decode_time": None if first else ms}

    def _final(self, end: Delta, elapsed_ms: float, *, counted: bool = True) -> dict[str, Any]:
        event = self._timed(elapsed_ms, counted=counted)
        event["generated_text"] = "".join(self._parts)
        reason = end.finish or FinishReason.ABORT
        event["details"] = (
            {
                "finish_reason": finish_reason(reason, end.matched_stop),
                "generated_tokens": self._count,
                "seed": self._plan.seed,
            }
            if self._plan.details
            else None
        )
        event["token"] = {"id": self._last_id, "text": None}
        return event


# ---- /generate, vLLM flavour ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmPlan:
    request: GenerationRequest
    prompt_text: str  # what the response echoes before each completion


def vllm_request(
    body: VllmGenerateRequest, *, request_id: str, bounds: RequestBounds, vocab_size: int,
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> VllmPlan:
    prompt_text = _vllm_prompt_text(body.prompt)
    _check_sampling(body.temperature, body.top_k, body.top_p, body.repetition_penalty,
                    greedy_ok=True)
    n = _check_counts(body, bounds)
    _check_stop(body.stop, bounds)
    _check_sampled_counts(body)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    sampling = Sampling(
        max_new_tokens=VLLM_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),  # -1: off
        seed=body.seed,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        n=n,
        stop=stop,
        stop_token_ids=_stop_token_ids(body.stop_token_ids or (), vocab_size),
        ignore_eos=bool(body.ignore_eos),
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens is not False,
        budget=VLLM_REFUSES,
    )
    omitted = omitted_fields(body, VLLM_DEFAULTED)
    if body.max_tokens is None:
        omitted.append("max_new_tokens")
    sampling = with_model_defaults(sampling, defaults, omitted)
    request = GenerationRequest(
        request_id=request_id, model=body.model or "", prompt=TextPrompt(_full_prompt(body.prompt)),
        sampling=sampling, stream=bool(body.stream), protocol="mindie",
    )
    return VllmPlan(request=request, prompt_text=prompt_text)


def _vllm_prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """MindIE echoes the plain prompt, or the first text item of a multimodal list."""
    if isinstance(prompt, str):
        return _text_input(prompt, "Prompt", "prompt")
    _text_input(prompt, "Prompt", "prompt")
    return next(str(item["text"]) for item in prompt if "text" in item)


def _full_prompt(prompt: str | list[dict[str, Any]]) -> str:
    return prompt if isinstance(prompt, str) else multimodal_text(prompt, "Prompt", "prompt")


def _check_counts(body: VllmGenerateRequest, bounds: RequestBounds) -> int:
    if body.max_tokens is not None and not 0 < body.max_tokens <= MAX_INT32:
        raise invalid(
            f"Parameter max_tokens must be (0,{MAX_INT32}], got {body.max_tokens}", "max_tokens"
        )
    n = 1 if body.n is None else body.n
    limit = min(MAX_N, bounds.max_n)
    if not 1 <= n <= limit:
        raise invalid(f"Parameter [n] should be in [1, {limit}], got {n}. ", "n")
    best_of = body.best_of
    if best_of is not None and best_of != n:
        best_of_limit = min(MAX_N, bounds.max_best_of)
        if not 1 <= best_of <= best_of_limit:
            raise invalid(
                f"Parameter [best_of] should be in [1, {best_of_limit}], got {best_of}.", "best_of"
            )
        if best_of < n:
            raise invalid(
                f"best_of should greater than or equal to n, but best_of is {best_of}, n is {n}.",
                "best_of",
            )
        raise Unsupported("best_of greater than n is not supported by this server", param="best_of")
    presence, frequency = body.presence_penalty, body.frequency_penalty
    if presence is not None and not -2.0 <= presence <= 2.0:
        raise invalid(
            f"Parameter presence_penalty not in [-2.0, 2.0], but got {presence}.",
            "presence_penalty",
        )
    if frequency is not None and not -2.0 <= frequency <= 2.0:
        raise invalid(
            f"Parameter frequency_penalty should be in [-2.0, 2.0], got {frequency}.",
            "frequency_penalty",
        )
    if body.seed is not None and body.seed > MAX_INT64:
        raise invalid(f"Parameter seed must be in [0, {MAX_INT64}], got {body.seed}.", "seed")
    return n


def _check_sampled_counts(body: VllmGenerateRequest) -> None:
    """MindIE's `SetReturnSeqCount`: several sequences only when sampling, i.e. with a
    temperature above 0 given (the model's default temperature does not count)."""
    count = max(body.n or 1, body.best_of or 1)
    if count > 1 and not body.temperature:
        raise invalid(
            "Best_of/N can not greater than 1 when temperature is 0 or not set, but best_of is "
            f"{body.best_of}, n is {body.n}.",
            "n" if body.best_of is None else "best_of",
        )


def _check_stop(stop: str | list[str] | None, bounds: RequestBounds) -> None:
    """MindIE's `AssignStopStrings` (its words for a string and for a list), within this
    server's caps on the count and length of stop sequences."""
    longest = bounds.max_stop_length
    if isinstance(stop, str):
        if not 1 <= len(stop) <= longest:
            raise invalid(
                f"Input validation error: length of `stop` must be in [1, {longest}], but got "
                f"{len(stop)}",
                "stop",
            )
        return
    stop = stop or []
    if len(stop) > bounds.max_stop_sequences:
        raise invalid(
            f"Input validation error: `stop` supports up to {bounds.max_stop_sequences} stop "
            f"sequences. Given: {len(stop)}",
            "stop",
        )
    total = sum(len(s) for s in stop)
    if total > MAX_TOTAL_STOP or not all(1 <= len(s) <= longest for s in stop):
        raise invalid(
            f"Input validation error: `stop` must be list[string] if list, and item length in "
            f"[1, {longest}] with total <= {MAX_TOTAL_STOP}",
            "stop",
        )


def _stop_token_ids(ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """MindIE drops ids outside [0, INT32_MAX] and keeps each once (`AssignStopTokenIds`); an id
    at or past the vocabulary can never be generated, so it stops nothing there either and is
    dropped here too, where vLLM would refuse the request."""
    return tuple(sorted({t for t in ids if 0 <= t < vocab_size}))


def to_vllm_response(result: GenerationResult, plan: VllmPlan) -> dict[str, Any]:
    """`{"text": ["<prompt> <completion>", ...]}`: MindIE joins prompt and output with a space."""
    prefix = plan.prompt_text + " "
    return {"text": [prefix + choice.text for choice in result.choices]}


def vllm_chunk(delta: Delta, n: int) -> dict[str, Any]:
    """One stream chunk: this choice's new text, "" for the others."""
    texts = [""] * n
    texts[delta.choice] = delta.text
    return {"text": texts}


# ---- /v1/tokenizer -----------------------------------------------------------------------------


def to_tokenizer_response(token_ids: Sequence[int], texts: Sequence[str]) -> dict[str, Any]:
    return {"token_number": len(token_ids), "tokens": list(texts)}
