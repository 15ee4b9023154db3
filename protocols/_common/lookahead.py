"""Stream helpers for per-token protocols: pair a choice's last `Delta` with its `ChoiceEnd`
without holding any token back, and split a merged delta's text over its tokens.

Protocols whose last stream event must carry the end of generation on the last token (TGI's
`generated_text`, MindIE's `/infer` final event) need to know, when a `Delta` arrives, whether the
choice ends with it. Engines yield the last `Delta` and its `ChoiceEnd` back to back (both come
from the same engine output), so after each `Delta` the next event is fetched in a task and given
one turn of the event loop: if it is that choice's `ChoiceEnd`, the two are yielded together;
otherwise the `Delta` goes out alone at once and the fetch keeps running. The peek costs a task
(~8 us), so `may_end` (see `EndCandidates`) skips it for deltas that cannot be the last.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from typing import Any

from server.core.types import ChoiceEnd, Delta, GenerationEvent

_END: Any = object()


async def _next(events: AsyncIterator[GenerationEvent]) -> GenerationEvent:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        end: GenerationEvent = _END  # a task must not end with StopAsyncIteration
        return end


async def with_ends(
    events: AsyncIterator[GenerationEvent],
    may_end: Callable[[Delta], bool] | None = None,
) -> AsyncGenerator[GenerationEvent | tuple[Delta, ChoiceEnd], None]:
    """`events`, where a `Delta` immediately followed by its choice's `ChoiceEnd` is one pair.

    Only deltas for which `may_end` is true (all, without it) are peeked; an end after another
    delta comes alone, as do ends without a token (aborts).
    """
    following: asyncio.Task[GenerationEvent] | None = None
    try:
        while True:
            if following is None:
                event = await _next(events)
            else:
                event, following = await following, None
            if event is _END:
                return
            if not isinstance(event, Delta) or (may_end is not None and not may_end(event)):
                yield event
                continue
            following = asyncio.ensure_future(_next(events))
            await asyncio.sleep(0)
            end = _ready_end(following, event.choice)
            if end is None:
                yield event
            else:
                following = None
                yield event, end
    finally:
        if following is not None and not following.done():
            following.cancel()
            with contextlib.suppress(BaseException):
                await following


def _ready_end(task: asyncio.Task[GenerationEvent], choice: int) -> ChoiceEnd | None:
    if not task.done() or task.cancelled() or task.exception() is not None:
        return None
    result = task.result()
    return result if isinstance(result, ChoiceEnd) and result.choice == choice else None


def token_pieces(delta: Delta, token_texts: Callable[[list[int]], list[str]]) -> list[str]:
    """The text of each token of `delta`, joining exactly to `delta.text`.

    vLLM merges several tokens into one delta when the consumer falls behind. Their own texts
    (from the logprobs, else decoded one by one) are used when they join to the delta's text;
    otherwise (a multi-byte character split across tokens, a held-back stop string) the whole
    text goes to the last token and the others get "".
    """
    ids = delta.token_ids
    if len(ids) <= 1:
        return [delta.text] * len(ids)
    if len(delta.logprobs) == len(ids):
        pieces = [entry.token for entry in delta.logprobs]
    else:
        pieces = token_texts(list(ids))
    if "".join(pieces) == delta.text:
        return pieces
    return [""] * (len(ids) - 1) + [delta.text]


class EndCandidates:
    """A cheap `may_end` for `with_ends`: a delta may end its choice if it reaches the token limit,
    holds a stop token (EOS), or the request has stop strings (any token may complete one)."""

    def __init__(
        self, *, max_new_tokens: int | None, stop_token_ids: Iterable[int | None],
        stop_strings: bool,
    ) -> None:
        self._limit = max_new_tokens
        self._stop_ids = frozenset(t for t in stop_token_ids if t is not None)
        self._any = stop_strings
        self._counts: dict[int, int] = {}

    def __call__(self, delta: Delta) -> bool:
        count = self._counts.get(delta.choice, 0) + len(delta.token_ids)
        self._counts[delta.choice] = count
        return (
            self._any
            or not delta.token_ids
            or (self._limit is not None and count >= self._limit)
            or not self._stop_ids.isdisjoint(delta.token_ids)
        )
