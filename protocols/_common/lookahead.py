"""Pair a choice's last `Delta` with its `ChoiceEnd`, without holding any token back.

Protocols whose last stream event must carry the end of generation on the last token (TGI's
`generated_text`, MindIE's `/infer` final event) need to know, when a `Delta` arrives, whether the
choice ends with it. Engines yield the last `Delta` and its `ChoiceEnd` back to back (both come
from the same engine output), so after each `Delta` the next event is fetched in a task and given
one turn of the event loop: if it is that choice's `ChoiceEnd`, the two are yielded together;
otherwise the `Delta` goes out alone at once and the fetch keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
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
) -> AsyncGenerator[GenerationEvent | tuple[Delta, ChoiceEnd], None]:
    """`events`, where a `Delta` immediately followed by its choice's `ChoiceEnd` is one pair."""
    following: asyncio.Task[GenerationEvent] | None = None
    try:
        while True:
            if following is None:
                event = await _next(events)
            else:
                event, following = await following, None
            if event is _END:
                return
            if not isinstance(event, Delta):
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
