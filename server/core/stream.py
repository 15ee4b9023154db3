"""`EventStream`: the events of one admitted request, with its timing and its clean-up.

Built by the service around an engine's event generator. The stream never knows the service:
it reports tokens to the observer and, when closed, hands itself to `on_close` exactly once.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from server.core.errors import DeadlineExceeded, GatewayError
from server.core.frozen import quick_init
from server.core.overhead import engine_wait_var
from server.core.timers import DelayQueue
from server.core.types import (
    AdapterHandle,
    Delta,
    Done,
    GenerationEvent,
    GenerationRequest,
    Started,
    TokenTiming,
    Usage,
)


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """How long one admitted request took, measured from admission."""

    seconds: float  # admission to close
    first_token_s: float | None = None  # admission to the first generated token
    mean_token_gap_s: float | None = None  # mean time between later tokens (MindIE TBT)


class RequestObserver(Protocol):
    """Metrics hook. Implemented outside the core (server/observability).

    `admitted` pairs with exactly one `finished`; `rejected` is a request that never ran.
    `token_gaps` gets the gaps between a request's tokens in batches (at most `GAP_BATCH` at a
    time, the rest when it ends), so the per-token path is an append.
    """

    def admitted(self, request: GenerationRequest) -> None: ...

    def first_token(self, request: GenerationRequest, seconds: float) -> None: ...

    def token_gaps(self, request: GenerationRequest, gaps: Sequence[float]) -> None: ...

    def finished(
        self,
        request: GenerationRequest,
        *,
        error_type: str | None,
        usage: Usage | None,
        timing: Timing,
    ) -> None: ...

    def rejected(self, request: GenerationRequest, error_type: str) -> None: ...


class NullObserver:
    def admitted(self, request: GenerationRequest) -> None:
        pass

    def first_token(self, request: GenerationRequest, seconds: float) -> None:
        pass

    def token_gaps(self, request: GenerationRequest, gaps: Sequence[float]) -> None:
        pass

    def finished(
        self,
        request: GenerationRequest,
        *,
        error_type: str | None,
        usage: Usage | None,
        timing: Timing,
    ) -> None:
        pass

    def rejected(self, request: GenerationRequest, error_type: str) -> None:
        pass


Abort = Callable[[], Coroutine[object, object, None]]
GAP_BATCH = 32  # token gaps reported to the observer at once


class EventStream:
    """Iterate once; `aclose()` always runs the clean-up (engine abort, `on_close`).

    Before returning it, the service primes the stream up to its first event after `Started`,
    so failures before any output raise from `start()` and get a real status.
    """

    __slots__ = (
        "__weakref__", "_abort", "_cancel_reason", "_cancelled", "_closed", "_done", "_events",
        "_failure", "_first_token_at", "_gaps", "_last_token_at", "_next", "_observer",
        "_on_close", "_primed", "_raise_next", "_started_at", "_timer", "_unreported", "_usage",
        "_wait", "adapter", "engine_id", "request",
    )

    def __init__(  # noqa: PLR0913 - the request, its events and the hooks around them
        self,
        request: GenerationRequest,
        events: AsyncGenerator[GenerationEvent, None],
        *,
        engine_id: str,
        adapter: AdapterHandle | None,
        abort: Abort,
        observer: RequestObserver,
        on_close: Callable[[EventStream], None],
    ) -> None:
        self.request = request
        self.engine_id = engine_id  # the engine's id of this request (unique per process)
        self.adapter = adapter
        self._events = events
        self._next = events.__anext__  # looked up once: it runs per event
        self._abort = abort
        self._observer = observer
        self._on_close = on_close
        self._primed: deque[GenerationEvent] = deque()
        self._done = False
        self._closed = False
        self._cancel_reason: GatewayError | None = None
        self._raise_next = False  # the cancel reason follows the output already produced
        self._failure: GatewayError | None = None
        self._cancelled = False
        self._started_at = time.monotonic()
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._gaps = 0
        self._unreported: list[float] = []  # token gaps not yet given to the observer
        self._usage: Usage | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._wait = engine_wait_var.get()  # the request's wait on the engine, until answered

    def __aiter__(self) -> EventStream:
        return self

    def __anext__(self) -> Awaitable[GenerationEvent]:
        # not a coroutine itself: it hands out `_pull()`, one coroutine frame per event, not two
        if self._primed:
            return self._next_primed()
        if self._done:
            raise StopAsyncIteration
        if self._raise_next:  # the cancel reason, after the output produced before it
            self._done = True
            assert self._cancel_reason is not None
            raise self._cancel_reason
        return self._pull()

    async def _next_primed(self) -> GenerationEvent:
        return self._primed.popleft()

    @property
    def finished(self) -> bool:
        """The engine's events ended (well or not): closing now needs no wait on the engine."""
        return self._done and not self._primed

    async def prime(self) -> None:
        """Pull events until the first one after `Started`, so early failures raise here."""
        while True:
            event = await self._pull()
            self._primed.append(event)
            if not isinstance(event, Started):
                if self.request.stream:
                    self._wait = None  # the headers go now: later tokens are not measured
                return

    async def _pull(self) -> GenerationEvent:  # noqa: C901, PLR0912 - token path inlined
        wait = self._wait
        try:
            if wait is None:
                event = await self._next()
            else:
                wait.enter()
                try:
                    event = await self._next()
                finally:
                    wait.leave()
        except StopAsyncIteration:
            self._done = True
            if self._cancel_reason is not None:
                raise self._cancel_reason from None
            raise
        except GatewayError as exc:
            self._done = True
            self._failure = exc
            raise
        if type(event) is Delta:  # the per-token path: kept short, no call but the clock's
            if self._cancel_reason is not None and event.finish is not None:
                return self._end_cancelled(event)
            if event.token_ids and self.request.stream:
                now = time.monotonic()
                last = self._last_token_at
                if last is None:
                    self._first_token(now)
                else:
                    self._gaps += 1
                    self._unreported.append(now - last)
                    if len(self._unreported) >= GAP_BATCH:
                        self._report_gaps()
                self._last_token_at = now
            return event
        if isinstance(event, Done):
            self._end(event)
        return event

    def _end_cancelled(self, delta: Delta) -> Delta:
        """The finishing delta of a cancelled request: what it produced goes out, then the
        cancel reason is raised."""
        assert self._cancel_reason is not None
        if not (delta.text or delta.token_ids):
            self._done = True
            raise self._cancel_reason
        self._raise_next = True
        return replace(delta, finish=None, matched_stop=None)

    def _first_token(self, now: float) -> None:
        self._first_token_at = now
        self._observer.first_token(self.request, now - self._started_at)

    def _report_gaps(self) -> None:
        if self._unreported:
            self._observer.token_gaps(self.request, self._unreported)
            self._unreported = []

    def _end(self, done: Done) -> None:
        self._done = True
        if self._cancel_reason is not None:
            raise self._cancel_reason
        self._usage = done.usage
        if not self.request.stream:
            self._observe_engine_timing(done)

    def _observe_engine_timing(self, done: Done) -> None:
        """Output delivered in one piece: token times as the engine reported them."""
        tokens = done.usage.completion_tokens
        if tokens == 0:
            return
        timing = done.timing or TokenTiming(
            first_token_s=time.monotonic() - self._started_at, decode_s=0.0
        )
        self._first_token_at = self._started_at + timing.first_token_s
        self._last_token_at = self._first_token_at + timing.decode_s
        self._observer.first_token(self.request, timing.first_token_s)
        self._gaps = max(tokens - self.request.sampling.n, 0) if done.timing else 0
        if self._gaps:
            self._observer.token_gaps(self.request, [timing.decode_s / self._gaps] * self._gaps)

    def cancel(self, reason: GatewayError | None = None) -> None:
        """Abort in the engine. With a reason, the stream then raises it (in-band error)."""
        if self._cancelled or self._done:
            return
        self._cancelled = True
        self._cancel_reason = reason
        asyncio.get_running_loop().create_task(self._abort())

    def arm_deadline(self, timeout_s: float | None) -> None:
        """A timer of the stream's own (`Deadlines` keeps the service's default one)."""
        if timeout_s:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(timeout_s, self.expire, timeout_s)

    def expire(self, timeout_s: float) -> None:
        """The deadline passed: end the request with `DeadlineExceeded` (if still running)."""
        # The error is built only when a deadline fires, not on every request's hot path.
        self.cancel(DeadlineExceeded(f"Request exceeded its deadline of {timeout_s:g} s"))

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        try:  # a cancel while aborting must not skip the clean-up: nothing would run it again
            if not self._done:
                self._cancelled = True
                await asyncio.shield(self._abort())
            await self._events.aclose()
        finally:
            self._report_gaps()
            self._on_close(self)

    @property
    def usage(self) -> Usage | None:
        """The usage the engine reported; None unless the request ran to its end."""
        return self._usage

    @property
    def error_type(self) -> str | None:
        if self._usage is not None:
            return None
        reason = self._cancel_reason or self._failure
        return reason.error_type if reason else "aborted"

    @property
    def timing(self) -> Timing:
        first, last = self._first_token_at, self._last_token_at
        gap = None
        if first is not None and last is not None and self._gaps:
            gap = (last - first) / self._gaps
        return Timing(
            seconds=time.monotonic() - self._started_at,
            first_token_s=None if first is None else first - self._started_at,
            mean_token_gap_s=gap,
        )


class Deadlines:
    """The default request deadline of many streams on one loop timer (`DelayQueue`), each
    stream held weakly; a request with a timeout of its own arms its own timer instead."""

    def __init__(self, timeout_s: float) -> None:
        self._queue: DelayQueue[weakref.ref[EventStream]] = DelayQueue(timeout_s, self._due)
        self._tidy_at = TIDY_AT

    def add(self, stream: EventStream) -> None:
        queue = self._queue
        queue.add(weakref.ref(stream))
        if len(queue) > self._tidy_at:  # closed requests wait for nothing: forget them
            queue.drop(_still_open)
            self._tidy_at = 2 * len(queue) + TIDY_AT

    def _due(self, ref: weakref.ref[EventStream]) -> None:
        stream = ref()
        if stream is not None:
            stream.expire(self._queue.delay_s)


TIDY_AT = 64  # waiting deadlines beyond twice the open ones (plus this) are tidied


def _still_open(ref: weakref.ref[EventStream]) -> bool:
    stream = ref()
    return stream is not None and not stream.closed
