"""`GenerationResult` and events → `text_completion` bodies and SSE bytes as vLLM 0.32 writes
them (PROTOCOLS.md §2.2), rendered through one `CompletionView` per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocols.openai_v1 import schema
from protocols.openai_v1.replies import (
    ChunkWriter,
    ReplyMeta,
    StreamUsage,
    clamp_logprob,
    prompt_logprobs_json,
    stream_usage,
    usage_dict,
)
from server.core.types import (
    Choice,
    Delta,
    Done,
    GenerationEvent,
    GenerationResult,
    Prompt,
    Started,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
)

TokenTexts = Callable[[list[int]], list[str]]
JSON = dict[str, Any]
# (token text, logprob or None, {token text: logprob} or None): one row of completion logprobs
LogprobRow = tuple[str, float | None, dict[str, float] | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionView:
    """How one completion request wants its answer rendered.

    `echo_texts[k]` is prompt k's text for `echo` when the engine's `Started` does not carry it;
    `token_texts` names prompt tokens that carry no logprob.
    """

    meta: ReplyMeta
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    echo_only: bool = False
    echo_texts: tuple[str | None, ...] = ()
    usage: StreamUsage = field(default_factory=StreamUsage)
    return_token_ids: bool = False
    prompt_logprobs: bool = False
    token_texts: TokenTexts = field(default=lambda ids: ["" for _ in ids])

    @classmethod
    def of(
        cls,
        body: schema.CompletionRequest,
        meta: ReplyMeta,
        *,
        prompts: Sequence[Prompt],
        token_texts: TokenTexts,
    ) -> CompletionView:
        return cls(
            meta=meta,
            n=body.n,
            logprobs=body.logprobs,
            echo=bool(body.echo),
            echo_only=bool(body.echo) and body.max_tokens == 0,
            echo_texts=tuple(_prompt_text(p, token_texts) for p in prompts),
            usage=StreamUsage.of(body),
            return_token_ids=bool(body.return_token_ids),
            prompt_logprobs=body.prompt_logprobs is not None,
            token_texts=token_texts,
        )


def _prompt_text(prompt: Prompt, token_texts: TokenTexts) -> str | None:
    if isinstance(prompt, TextPrompt):
        return prompt.text
    if isinstance(prompt, TokenPrompt):
        return "".join(token_texts(list(prompt.token_ids)))
    return None


class _Echo:
    """The prompt side of a choice (prompt k = choice // n): text, logprob rows, token ids,
    from the `Started` of that prompt."""

    def __init__(self, view: CompletionView) -> None:
        self._view = view
        self._started: dict[int, Started] = {}
        self._rows: dict[int, list[LogprobRow]] = {}

    def start(self, started: Started) -> None:
        self._started[started.prompt_index] = started

    def started(self, choice: int) -> Started | None:
        return self._started.get(choice // self._view.n)

    def text(self, choice: int) -> str:
        k = choice // self._view.n
        started = self._started.get(k)
        if started is not None and started.prompt_text is not None:
            return started.prompt_text
        texts = self._view.echo_texts
        return (texts[k] if k < len(texts) else None) or ""

    def rows(self, choice: int) -> list[LogprobRow]:
        k = choice // self._view.n
        started = self._started.get(k)
        if started is None:
            return []
        if k not in self._rows:
            self._rows[k] = prompt_rows(started, self._view.token_texts)
        return self._rows[k]

    def start_offset(self, choice: int) -> int:
        """Text offset of the first logprob row: past the prompt when its rows are unknown."""
        return 0 if self.rows(choice) else len(self.text(choice))

    def prompt_token_ids(self, choice: int) -> list[int] | None:
        started = self._started.get(choice // self._view.n)
        return None if started is None else list(started.prompt_token_ids)

    def prompt_tokens(self, choice: int) -> int:
        started = self._started.get(choice // self._view.n)
        return 0 if started is None else len(started.prompt_token_ids)


def logprob_row(lp: TokenLogprob) -> LogprobRow:
    """Completion rows list the sampled token first, then the top alternatives."""
    top = {lp.token: clamp_logprob(lp.logprob)}
    for alt in lp.top:
        top.setdefault(alt.token, clamp_logprob(alt.logprob))
    return (lp.token, clamp_logprob(lp.logprob), top)


def prompt_rows(started: Started, token_texts: TokenTexts) -> list[LogprobRow]:
    ids = list(started.prompt_token_ids)
    known = started.prompt_logprobs
    texts = token_texts(ids)
    rows: list[LogprobRow] = []
    for index, text in enumerate(texts):
        lp = known[index] if index < len(known) else None
        rows.append(logprob_row(lp) if lp is not None else (text, None, None))
    return rows


def completion_logprobs(rows: Iterable[LogprobRow], offset: int = 0) -> tuple[JSON, int]:
    """vLLM's `CompletionLogProbs`, and the text offset after its last token."""
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []
    for token, logprob, top in rows:
        text_offset.append(offset)
        offset += len(token)
        tokens.append(token)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
    body = {
        "text_offset": text_offset,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }
    return body, offset


def completion_response(result: GenerationResult, view: CompletionView) -> JSON:
    echo = _Echo(view)
    for started in result.prompts:
        echo.start(started)
    return {
        "id": view.meta.id,
        "object": "text_completion",
        "created": view.meta.created,
        "model": view.meta.model,
        "choices": [_completion_choice(choice, view, echo) for choice in result.choices],
        "service_tier": None,
        "system_fingerprint": view.meta.fingerprint,
        "usage": usage_dict(result.usage),
        "kv_transfer_params": None,
    }


def _completion_choice(choice: Choice, view: CompletionView, echo: _Echo) -> JSON:
    text = "" if view.echo_only else choice.text
    rows = [] if view.echo_only else [logprob_row(lp) for lp in choice.logprobs]
    offset = 0
    if view.echo:
        text = echo.text(choice.index) + text
        if view.logprobs is not None:
            rows = echo.rows(choice.index) + rows
            offset = echo.start_offset(choice.index)
    prompt_ids = echo.prompt_token_ids(choice.index) if view.return_token_ids else None
    return {
        "index": choice.index,
        "text": text,
        "logprobs": completion_logprobs(rows, offset)[0] if view.logprobs is not None else None,
        "finish_reason": choice.finish_reason.value,
        "stop_reason": choice.matched_stop,
        "prompt_logprobs": (
            prompt_logprobs_json(echo.started(choice.index)) if view.prompt_logprobs else None
        ),
        "prompt_token_ids": prompt_ids,
        "token_ids": list(choice.token_ids) if view.return_token_ids else None,
    }


class CompletionStreamEncoder:
    """Events → `text_completion` SSE bytes, chunk for chunk as vLLM 0.32 writes them
    (PROTOCOLS.md §2.2); with `echo` the prompt rides on each choice's first chunk."""

    def __init__(self, view: CompletionView) -> None:
        self._view = view
        self._out = ChunkWriter(view.meta, "text_completion")
        self._echo = _Echo(view)
        self._opened: set[int] = set()  # choices that sent their first chunk
        self._offsets: dict[int, int] = {}
        self._generated: dict[int, int] = {}

    def encode(self, event: GenerationEvent) -> bytes:
        if isinstance(event, Delta):
            return self._output(event)
        if isinstance(event, Started):
            self._echo.start(event)
            return b""
        return self._done(event)

    def _output(self, event: Delta) -> bytes:
        i, view = event.choice, self._view
        first = i not in self._opened
        end = event.finish
        if end is None and not first and not event.text and not event.token_ids:
            return b""
        self._opened.add(i)
        self._generated[i] = self._generated.get(i, 0) + len(event.token_ids)
        text = "" if view.echo_only else event.text
        rows = (
            []
            if view.echo_only or view.logprobs is None
            else [logprob_row(lp) for lp in event.logprobs]
        )
        prompt_ids = None
        if first and view.echo:
            text = self._echo.text(i) + text
            if view.logprobs is not None:
                rows = self._echo.rows(i) + rows
                self._offsets[i] = self._echo.start_offset(i)
        if first and (view.echo or view.return_token_ids):
            prompt_ids = self._echo.prompt_token_ids(i)
        choice = {
            "index": i,
            "text": text,
            "logprobs": self._logprobs(i, rows),
            "finish_reason": None if end is None else end.value,
            "stop_reason": None if end is None else event.matched_stop,
            "prompt_token_ids": prompt_ids,
            "token_ids": list(event.token_ids) if view.return_token_ids else None,
        }
        last = end is not None and not view.usage.include
        return self._out.chunk(choice, self._usage(i), last=last)

    def _done(self, event: Done) -> bytes:
        if not self._view.usage.include:
            return b""
        usage = event.usage
        totals = stream_usage(usage.prompt_tokens, usage.completion_tokens)
        return self._out.chunk(None, totals, last=True)

    def _logprobs(self, choice: int, rows: list[LogprobRow]) -> JSON | None:
        if self._view.logprobs is None:
            return None
        body, self._offsets[choice] = completion_logprobs(rows, self._offsets.get(choice, 0))
        return body

    def _usage(self, choice: int) -> JSON | None:
        if not self._view.usage.continuous:
            return None
        return stream_usage(self._echo.prompt_tokens(choice), self._generated.get(choice, 0))
