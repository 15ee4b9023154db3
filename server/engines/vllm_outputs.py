"""vLLM's `RequestOutput`s → the port's events: `Started`, `Delta`s (the last one of a choice
carrying its finish), `Done`; with logprobs and the engine's token times."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from server.core.errors import EngineError, InvalidRequest
from server.core.types import (
    Delta,
    Done,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    Sampling,
    Started,
    TokenLogprob,
    TokenTiming,
    TopLogprob,
    Usage,
)
from server.engines.vllm_prompts import PreparedPrompt

if TYPE_CHECKING:
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.v1.metrics.stats import RequestStateStats

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "repetition": FinishReason.STOP,
}


class EventFolder:
    """Folds vLLM's `RequestOutput`s of one request into the port's events."""

    def __init__(self, prompt: PreparedPrompt, request: GenerationRequest, max_tokens: int) -> None:
        self._prompt = prompt
        self._max_tokens = max_tokens
        self._choices = request.sampling.n
        self._top = request.output.logprobs
        self._prompt_top = request.output.prompt_logprobs
        self._final_only = not request.stream
        self._sampling = request.sampling
        self._structured = request.sampling.structured is not None
        self._started = False
        self._ended: set[int] = set()
        self._generated = 0
        self._timing: TokenTiming | None = None

    def fold(self, output: RequestOutput) -> Iterator[GenerationEvent]:
        """The events of one output; the first output also brings `Started`.

        Waiting for it means vLLM has accepted the request (its validation errors come before
        any event) and prompt logprobs are known.
        """
        if not self._started:
            yield self._start(output.prompt_logprobs)
        for completion in output.outputs:
            delta = self._delta(completion)
            if delta is not None:
                yield delta
        if self._final_only and output.finished:
            self._timing = _token_timing(output.metrics)

    def closing(self) -> Iterator[GenerationEvent]:
        if not self._started:
            yield self._start(None)
        for index in range(self._choices):
            if index not in self._ended:
                yield Delta(choice=index, text="", finish=FinishReason.ABORT)
        usage = Usage(prompt_tokens=len(self._prompt.token_ids), completion_tokens=self._generated)
        yield Done(usage=usage, timing=self._timing)

    def _start(self, prompt_logprobs: Sequence[Mapping[int, Logprob] | None] | None) -> Started:
        self._started = True
        return Started(
            prompt_token_ids=tuple(self._prompt.token_ids),
            prompt_text=self._prompt.text,
            prompt_logprobs=_prompt_logprobs(
                self._prompt.token_ids, prompt_logprobs, self._prompt_top
            ),
            max_tokens=self._max_tokens,
        )

    def _delta(self, completion: CompletionOutput) -> Delta | None:
        token_ids = tuple(completion.token_ids)
        reason = completion.finish_reason
        ends = reason is not None and completion.index not in self._ended
        if not (completion.text or token_ids or ends):
            return None
        self._generated += len(token_ids)
        finish = None
        if ends:
            assert reason is not None
            if reason == "error" and self._structured and not self._generated:
                raise _uncompiled_constraint()
            if reason == "error" and self._structured:
                restrictions = _token_restrictions(self._sampling)
                if restrictions:
                    raise _no_allowed_token(restrictions)
            finish = _finish_reason(reason)
            self._ended.add(completion.index)
        return Delta(
            choice=completion.index,
            text=completion.text,
            token_ids=token_ids,
            logprobs=_sample_logprobs(token_ids, completion.logprobs, self._top),
            finish=finish,
            matched_stop=completion.stop_reason if ends else None,
        )


def _token_timing(stats: RequestStateStats | object) -> TokenTiming | None:
    """The engine's token times of a finished request (`RequestOutput.metrics`), if it kept them."""
    first_latency = getattr(stats, "first_token_latency", 0.0)
    first, last = getattr(stats, "first_token_ts", 0.0), getattr(stats, "last_token_ts", 0.0)
    if not first_latency or not first:
        return None
    return TokenTiming(first_token_s=first_latency, decode_s=max(last - first, 0.0))


def _uncompiled_constraint() -> InvalidRequest:
    """A structured request the engine failed before its first token. On this engine that is
    its constraint failing to compile (vLLM then fails only that request; a regex gets 5 s):
    vLLM's other failure there, pre-processing, is mostly the same grammar set-up."""
    return InvalidRequest(
        "The engine could not compile this request's structured output constraint (a regex "
        "may take at most 5 s): simplify the regex, grammar or JSON schema."
    )


def _token_restrictions(sampling: Sampling) -> list[str]:
    """The request's fields that can leave a structured output constraint no token to take:
    vLLM then samples a token the grammar rejects and ends the request with an error
    (`min_tokens` and `ignore_eos` cannot: the grammar's end wins, or it stops constraining)."""
    named = {"allowed_token_ids": sampling.allowed_token_ids is not None,
             "bad_words": bool(sampling.bad_words)}
    return [name for name, given in named.items() if given]


def _no_allowed_token(restrictions: list[str]) -> InvalidRequest:
    """vLLM 0.32's scheduler ends a request whose sampled token its grammar rejects
    ("grammar rejected tokens"; vLLM's own server answers 500): on a structured request with
    these restrictions, the restrictions and the constraint left no token in common."""
    return InvalidRequest(
        "The structured output constraint and " + ", ".join(restrictions) + " left no token "
        "to generate: allow more tokens, or widen the constraint."
    )


def _finish_reason(reason: str) -> FinishReason:
    if reason == "error":
        raise EngineError("the engine failed while generating this request")
    return _FINISH_REASONS.get(reason, FinishReason.STOP)


def _sample_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[Mapping[int, Logprob] | None] | None,
    top_n: int | None,
) -> tuple[TokenLogprob, ...]:
    if positions is None or top_n is None:
        return ()
    return tuple(
        _token_logprob(token_id, position, top_n)
        for token_id, position in zip(token_ids, positions, strict=False)
        if position is not None
    )


def _prompt_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[Mapping[int, Logprob] | None] | None,
    top_n: int | None,
) -> tuple[TokenLogprob | None, ...]:
    if positions is None or top_n is None:
        return ()
    return tuple(
        None if position is None else _token_logprob(token_id, position, top_n)
        for token_id, position in zip(token_ids, positions, strict=False)
    )


def _token_logprob(token_id: int, position: Mapping[int, Logprob], top_n: int) -> TokenLogprob:
    """vLLM gives the chosen token plus the `top_n` best by rank (which may include it)."""
    ranked = sorted(position.items(), key=lambda item: _rank(item[1]))[:top_n]
    top = tuple(
        TopLogprob(token_id=tid, token=lp.decoded_token or "", logprob=lp.logprob, rank=lp.rank)
        for tid, lp in ranked
    )
    own = position.get(token_id)
    if own is None:
        return TokenLogprob(token_id=token_id, token="", logprob=float("-inf"), top=top)
    return TokenLogprob(
        token_id=token_id, token=own.decoded_token or "", logprob=own.logprob, top=top,
        rank=own.rank,
    )


def _rank(logprob: Logprob) -> int:
    return logprob.rank if logprob.rank is not None else 1 << 62
