"""`BatchStream`: several started requests read as one event stream (a list of prompts, a DJL
multi-adapter batch). Each request runs on its own; events come out in arrival order."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace

from server.core.stream import EventStream
from server.core.types import Delta, Done, GenerationEvent, GenerationRequest, Started, Usage

_Item = tuple[int, GenerationEvent | BaseException | None]


class BatchStream:
    """Choice i of request k becomes k * n + i; every request's `Started` is forwarded with its
    `prompt_index`; one `Done` at the end sums the usage. The first failure of any request ends
    the whole stream (raised to the reader); `aclose()` closes every request."""

    def __init__(self, streams: list[EventStream]) -> None:
        self._streams = streams
        self.request: GenerationRequest = streams[0].request
        counts = (s.request.sampling.n for s in streams)
        self._offsets = list(itertools.accumulate(counts, initial=0))
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._remaining = len(streams)
        self._totals = [0, 0]
        self._finished = False
        self._closed = False

    def __aiter__(self) -> BatchStream:
        return self

    async def __anext__(self) -> GenerationEvent:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._pump(k, s)) for k, s in enumerate(self._streams)
            ]
        while self._remaining:
            k, item = await self._queue.get()
            if item is None:
                self._remaining -= 1
                continue
            if isinstance(item, BaseException):
                self._remaining = 0
                self._finished = True
                raise item
            forwarded = self._reindex(k, item)
            if forwarded is not None:
                return forwarded
        if self._finished:
            raise StopAsyncIteration
        self._finished = True
        return Done(usage=Usage(prompt_tokens=self._totals[0], completion_tokens=self._totals[1]))

    def _reindex(self, k: int, event: GenerationEvent) -> GenerationEvent | None:
        if isinstance(event, Delta):
            return event if k == 0 else replace(event, choice=event.choice + self._offsets[k])
        if isinstance(event, Started):
            return event if k == 0 else replace(event, prompt_index=k)
        self._totals[0] += event.usage.prompt_tokens
        self._totals[1] += event.usage.completion_tokens
        return None

    async def _pump(self, k: int, stream: EventStream) -> None:
        try:
            async for event in stream:
                self._queue.put_nowait((k, event))
            self._queue.put_nowait((k, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # forwarded to the reader, raised there
            self._queue.put_nowait((k, exc))

    @property
    def finished(self) -> bool:
        """Every request's events ended: closing needs no wait on the engine."""
        return all(stream.finished for stream in self._streams)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for stream in self._streams:
            await stream.aclose()
