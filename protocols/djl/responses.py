"""LMI's answers, pure: generation results and events → the JSON DJL's vLLM handlers write.

Two schemas; `Plan.legacy` picks one:
- async mode, LMI's default since v17 (`djl_python/lmi_vllm/request_response_utils.py`): an
  object `{"generated_text"}`; with `details` also `{"finish_reason", "generated_tokens",
  "seed", "prefill", "tokens"}`, tokens `{"id", "text", "logprob"}`, `prefill` (with
  `decoder_input_details`) without the first prompt token, which has no logprob. Stream lines
  `{"index", "token": {"id", "text", "logprob"}, "generated_text": null, "details": null}`; the
  last one carries the text (after the prompt with `return_full_text`) and, with `details`,
  `{"finish_reason", "seed", "generated_tokens", "input_length"}`. Finish reasons are vLLM's
  (`length`, `stop`, `abort`); an error mid-stream is vLLM's error object, which LMI passes on.
- rolling batch, `option.rolling_batch=vllm` (`djl_python/output_formatter.py`,
  `_json_output_formatter` / `_jsonlines_output_formatter`; `request_io.py` `Token.as_dict`):
  tokens `{"id", "text", "log_prob"}`; details `{"finish_reason", "generated_tokens", "inputs",
  "tokens"}` (+ `prefill`, `best_of_sequences`); stream lines `{"token"}`, the last adding
  `generated_text` and, with `details`, `{"finish_reason", "generated_tokens", "inputs"}`;
  reasons `length`, `eos_token`, `stop_sequence`; an error mid-stream is LMI's error line.

Deliberate differences: LMI's async non-streamed details put vLLM's `stop_reason` (null unless a
stop string or token matched) under `finish_reason`; here it is the finish reason its own stream
reports (`finish_reason or stop_reason`). A list of inputs answers one object per input in both
schemas (async LMI would answer the first prompt only).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from protocols.djl.translate import Plan
from server.core.types import (
    Choice,
    Delta,
    FinishReason,
    GenerationResult,
    Started,
    TokenLogprob,
)
from server.http import jsonio

NO_TOKEN = -1  # the id LMI gives a line that carries no token (an end without output, an error)


def finish_reason(reason: FinishReason, matched_stop: str | int | None) -> str:
    """LMI's rolling-batch reasons: length, eos_token, stop_sequence, abort."""
    if reason is FinishReason.LENGTH:
        return "length"
    if reason is FinishReason.ABORT:
        return "abort"
    return "stop_sequence" if isinstance(matched_stop, str) else "eos_token"


def _reason(plan: Plan, reason: FinishReason, matched_stop: str | int | None) -> str:
    return finish_reason(reason, matched_stop) if plan.legacy else reason.value


def token(token_id: int, text: str, logprob: float | None, *, legacy: bool) -> dict[str, Any]:
    return {"id": token_id, "text": text, ("log_prob" if legacy else "logprob"): logprob}


def _tokens(choice: Choice, legacy: bool) -> list[dict[str, Any]]:
    entries = choice.logprobs
    return [
        token(tid, entries[i].token if i < len(entries) else "",
              entries[i].logprob if i < len(entries) else None, legacy=legacy)
        for i, tid in enumerate(choice.token_ids)
    ]


def _prefill(started: Started, texts: Sequence[str], legacy: bool) -> list[dict[str, Any]]:
    """Prompt tokens with their logprobs. The first has none: the rolling batch lists it with
    null, async mode leaves it out (`convert_completion_prefill_to_tgi_prefill`)."""
    entries = started.prompt_logprobs
    out = []
    for i, tid in enumerate(started.prompt_token_ids):
        entry = entries[i] if i < len(entries) else None
        if entry is None and not legacy:
            continue
        text = texts[i] if i < len(texts) else (entry.token if entry else "")
        out.append(token(tid, text, entry.logprob if entry else None, legacy=legacy))
    return out


def _sequence(choice: Choice, text_prefix: str) -> dict[str, Any]:
    return {
        "generated_text": text_prefix + choice.text,
        "finish_reason": finish_reason(choice.finish_reason, choice.matched_stop),
        "generated_tokens": len(choice.token_ids),
        "tokens": _tokens(choice, True),
    }


def _details(
    k: int, choices: Sequence[Choice], plan: Plan, started: Started, texts: Sequence[str]
) -> dict[str, Any]:
    best = choices[0]
    reason = _reason(plan, best.finish_reason, best.matched_stop)
    if not plan.legacy:
        return {
            "finish_reason": reason, "generated_tokens": len(best.token_ids), "seed": plan.seed,
            "prefill": _prefill(started, texts, False) if plan.prefill else [],
            "tokens": _tokens(best, False),
        }
    details: dict[str, Any] = {
        "finish_reason": reason, "generated_tokens": len(best.token_ids),
        "inputs": plan.inputs[k], "tokens": _tokens(best, True),
    }
    if plan.prefill:
        details["prefill"] = _prefill(started, texts, True)
    if len(choices) > 1:
        prefix = plan.inputs[k] if plan.full_text else ""
        details["best_of_sequences"] = [_sequence(c, prefix) for c in choices[1:]]
    return details


def to_response(
    result: GenerationResult, plan: Plan, prefill_texts: Sequence[Sequence[str]] = ()
) -> dict[str, Any] | list[dict[str, Any]]:
    """One object for a string input, a list (one per input) for a list of inputs.
    `prefill_texts[k]` are input k's prompt tokens' texts (for `decoder_input_details`)."""
    n = plan.requests[0].sampling.n
    by_index = sorted(result.choices, key=lambda c: c.index)
    outputs = []
    for k in range(len(plan.inputs)):
        choices = by_index[k * n:(k + 1) * n]
        prefix = plan.inputs[k] if plan.full_text else ""
        out: dict[str, Any] = {"generated_text": prefix + choices[0].text}
        if plan.details:
            out["details"] = _details(k, choices, plan, *_prompt(result, prefill_texts, k))
        outputs.append(out)
    return outputs[0] if plan.single else outputs


def _prompt(
    result: GenerationResult, prefill_texts: Sequence[Sequence[str]], k: int
) -> tuple[Started, Sequence[str]]:
    """Input k's prompt and its tokens' texts (none where the engine reported none)."""
    started = result.prompts[k] if k < len(result.prompts) else Started(prompt_token_ids=())
    return started, prefill_texts[k] if k < len(prefill_texts) else ()


def _vllm_error(message: str, status: int) -> dict[str, Any]:
    """vLLM's stream error object (`create_streaming_error_response`)."""
    unavailable = status == 503
    return {"error": {
        "message": message,
        "type": "ServiceUnavailableError" if unavailable else "InternalServerError",
        "param": None,
        "code": 503 if unavailable else 500,
    }}


class StreamEncoder:
    """LMI's JSON-lines stream: one line per token; the last line also carries
    `generated_text` (and `details` when asked). A delta's text goes on its last token, so the
    token texts always join to the generated text."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._parts: list[str] = [plan.inputs[0]] if plan.full_text else []
        self._count = 0
        self._input_length = 0
        # the bytes of a plain line (one token, ending nothing) around its id, text and logprob
        self._heads: dict[int, bytes] = {}  # per choice
        self._logprob_key = b',"log_prob":' if plan.legacy else b',"logprob":'
        self._line_end = b"}}\n" if plan.legacy else b'},"generated_text":null,"details":null}\n'

    def _head(self, choice: int) -> bytes:
        head = b'{"token":{"id":' if self._plan.legacy else b'{"index":%d,"token":{"id":' % choice
        self._heads[choice] = head
        return head

    def started(self, event: Started) -> None:
        self._input_length = len(event.prompt_token_ids)

    def encode(self, delta: Delta) -> bytes:
        """The lines of one delta; one token (the usual delta) without the generator, and
        without a dict unless it ends the stream."""
        ids = delta.token_ids
        if len(ids) != 1:
            return b"".join(self.lines(delta))
        entry = delta.logprobs[0] if delta.logprobs else None
        self._parts.append(delta.text)
        self._count += 1
        if delta.finish is None:
            head = self._heads.get(delta.choice) or self._head(delta.choice)
            return b"".join((
                head, str(ids[0]).encode(), b',"text":', jsonio.dumps_scalar(delta.text),
                self._logprob_key, b"null" if entry is None else jsonio.dumps_scalar(entry.logprob),
                self._line_end,
            ))
        tok = token(ids[0], delta.text, entry.logprob if entry else None, legacy=self._plan.legacy)
        return self._line(tok, delta if delta.finish is not None else None, delta.choice)

    def lines(self, delta: Delta) -> Iterator[bytes]:
        ids = delta.token_ids
        end = delta if delta.finish is not None else None
        legacy = self._plan.legacy
        if not ids:
            self._parts.append(delta.text)
            if end is not None:
                yield self._line(token(NO_TOKEN, "", None, legacy=legacy), end, delta.choice)
            return
        last = len(ids) - 1
        for i, tid in enumerate(ids):
            entry: TokenLogprob | None = delta.logprobs[i] if i < len(delta.logprobs) else None
            text = delta.text if i == last else ""
            self._parts.append(text)
            self._count += 1
            tok = token(tid, text, entry.logprob if entry else None, legacy=legacy)
            yield self._line(tok, end if i == last else None, delta.choice)

    def error(self, message: str, code: int) -> bytes:
        if not self._plan.legacy:
            return jsonio.dumps(_vllm_error(message, code)) + b"\n"
        line = {
            "token": token(NO_TOKEN, "", None, legacy=True),
            "generated_text": "".join(self._parts),
            "details": {"finish_reason": "error"}, "error": message, "code": code,
        }
        return jsonio.dumps(line) + b"\n"

    def _line(self, tok: dict[str, Any], end: Delta | None, choice: int) -> bytes:
        if self._plan.legacy:
            line: dict[str, Any] = {"token": tok}
        else:
            line = {"index": choice, "token": tok, "generated_text": None, "details": None}
        if end is not None and end.finish is not None:
            line["generated_text"] = "".join(self._parts)
            if self._plan.details:
                line["details"] = self._details(end.finish, end.matched_stop)
        return jsonio.dumps(line) + b"\n"

    def _details(self, finish: FinishReason, matched_stop: str | int | None) -> dict[str, Any]:
        reason = _reason(self._plan, finish, matched_stop)
        if self._plan.legacy:
            return {"finish_reason": reason, "generated_tokens": self._count,
                    "inputs": self._plan.inputs[0]}
        return {"finish_reason": reason, "seed": self._plan.seed,
                "generated_tokens": self._count, "input_length": self._input_length}
