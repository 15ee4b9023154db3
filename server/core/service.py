"""InferenceService: the one place for cross-protocol policy.

Lifecycle gate → admission (concurrency + bounded queue) → model/adapter resolution → engine →
an `EventStream` whose first event is already primed, so errors before the first byte raise here
and get a real status. Closing the stream (client gone, stopInfer, drain) aborts the engine request.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from server.core.adapters import AdapterRegistry
from server.core.collect import collect
from server.core.engine import Engine
from server.core.errors import (
    DeadlineExceeded,
    GatewayError,
    ModelNotFound,
    Overloaded,
    RequestNotFound,
    ServiceUnavailable,
)
from server.core.lifecycle import Lifecycle
from server.core.types import (
    AdapterHandle,
    ChoiceEnd,
    Delta,
    Done,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
    Started,
    Usage,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    max_concurrent: int = 256  # requests handed to the engine at once
    max_queue: int = 512  # requests waiting for a slot; beyond: Overloaded (429)
    queue_timeout_s: float = 60.0
    request_timeout_s: float | None = 600.0
    retry_after_s: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """How long one admitted request took, measured from admission."""

    seconds: float  # admission to close
    first_token_s: float | None = None  # admission to the first generated token
    mean_token_gap_s: float | None = None  # mean time between later tokens (MindIE TBT)


class RequestObserver(Protocol):
    """Metrics hook. Implemented outside the core (server/metrics.py).

    `admitted` pairs with exactly one `finished`; `rejected` is a request that never ran.
    `token_gap` runs once per generated token: implementations must keep it tiny.
    """

    def admitted(self, request: GenerationRequest) -> None: ...

    def first_token(self, request: GenerationRequest, seconds: float) -> None: ...

    def token_gap(self, request: GenerationRequest, seconds: float) -> None: ...

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

    def token_gap(self, request: GenerationRequest, seconds: float) -> None:
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


class Admission:
    """A concurrency limit with a bounded queue in front of it."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._slots = asyncio.Semaphore(limits.max_concurrent)
        self.waiting = 0
        self.running = 0

    async def acquire(self) -> None:
        if self._slots.locked() or self.waiting:
            if self.waiting >= self._limits.max_queue:
                raise Overloaded(retry_after_s=self._limits.retry_after_s)
            self.waiting += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), self._limits.queue_timeout_s)
            except TimeoutError:
                raise Overloaded("Request timed out waiting in the queue") from None
            finally:
                self.waiting -= 1
        else:
            await self._slots.acquire()
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._slots.release()

    @property
    def saturated(self) -> bool:
        """Every slot is taken and the queue is full: the next request gets Overloaded."""
        return self._slots.locked() and self.waiting >= self._limits.max_queue


class EventStream:
    """The events of one admitted request. Iterate it once; `aclose()` always runs the cleanup."""

    def __init__(
        self,
        service: InferenceService,
        request: GenerationRequest,
        engine_id: str,
        adapter: AdapterHandle | None,
    ) -> None:
        self.request = request
        self.engine_id = engine_id
        self._service = service
        self._adapter = adapter
        self._events = service.engine.generate(request, engine_id, adapter)
        self._primed: list[GenerationEvent] = []
        self._done = False
        self._closed = False
        self._cancel_reason: GatewayError | None = None
        self._failure: GatewayError | None = None  # what the engine raised, for the metrics
        self._cancelled = False
        self._started_at = time.monotonic()
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._gaps = 0
        self._usage: Usage | None = None
        self._timer: asyncio.TimerHandle | None = None

    def __aiter__(self) -> EventStream:
        return self

    async def prime(self) -> None:
        """Pull events until the first one after `Started`, so early failures raise here."""
        while True:
            event = await self._next_from_engine()
            self._primed.append(event)
            if not isinstance(event, Started):
                return

    async def __anext__(self) -> GenerationEvent:
        if self._primed:
            return self._primed.pop(0)
        if self._done:
            raise StopAsyncIteration
        return await self._next_from_engine()

    async def _next_from_engine(self) -> GenerationEvent:
        try:
            event = await self._events.__anext__()
        except StopAsyncIteration:
            self._done = True
            if self._cancel_reason is not None:
                raise self._cancel_reason from None
            raise
        except GatewayError as exc:
            self._done = True
            self._failure = exc
            raise
        if self._cancel_reason is not None and isinstance(event, ChoiceEnd | Done):
            self._done = True
            raise self._cancel_reason
        self._observe(event)
        return event

    def _observe(self, event: GenerationEvent) -> None:
        if isinstance(event, Delta) and event.token_ids:
            now = time.monotonic()
            observer = self._service.observer
            if self._last_token_at is None:
                self._first_token_at = now
                observer.first_token(self.request, now - self._started_at)
            else:
                self._gaps += 1
                observer.token_gap(self.request, now - self._last_token_at)
            self._last_token_at = now
        elif isinstance(event, Done):
            self._usage = event.usage
            self._done = True

    def cancel(self, reason: GatewayError | None = None) -> None:
        """Abort in the engine. With a reason, the stream then raises it (in-band error)."""
        if self._cancelled or self._done:
            return
        self._cancelled = True
        self._cancel_reason = reason
        asyncio.get_running_loop().create_task(self._service.engine.abort(self.engine_id))

    def arm_deadline(self, timeout_s: float | None) -> None:
        if timeout_s:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(timeout_s, self._expire, timeout_s)

    def _expire(self, timeout_s: float) -> None:
        # The error is built only when a deadline fires, not on every request's hot path.
        self.cancel(DeadlineExceeded(f"Request exceeded its deadline of {timeout_s:g} s"))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if not self._done:
            self._cancelled = True
            await asyncio.shield(self._service.engine.abort(self.engine_id))
        try:
            await self._events.aclose()
        finally:
            self._service._finish(self, self._adapter, self._usage)

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


class InferenceService:
    def __init__(
        self,
        *,
        engine: Engine,
        adapters: AdapterRegistry,
        lifecycle: Lifecycle,
        limits: Limits,
        base_names: Sequence[str],
        observer: RequestObserver | None = None,
    ) -> None:
        self.engine = engine
        self.adapters = adapters
        self.lifecycle = lifecycle
        self.limits = limits
        self.base_names = frozenset(base_names)
        self.served_name = base_names[0]
        self.observer: RequestObserver = observer or NullObserver()
        self.admission = Admission(limits)
        self._active: dict[str, list[EventStream]] = {}
        self._abort_reason: GatewayError | None = None
        self._ids = itertools.count(1)

    # ---- generation --------------------------------------------------------------------
    async def start(self, request: GenerationRequest) -> EventStream:
        """Admit, resolve, start and prime one request. Raises GatewayError before any output.

        A queued request already counts as in flight, so a drain waits for it too.
        """
        try:
            self._gate()
        except GatewayError as exc:
            self.observer.rejected(request, exc.error_type)
            raise
        self.lifecycle.enter()
        try:
            await self._acquire()
        except BaseException as exc:
            self.lifecycle.leave()
            if isinstance(exc, GatewayError):
                self.observer.rejected(request, exc.error_type)
            raise
        try:
            adapter = await self._resolve(request)
        except GatewayError as exc:
            self._release_slot()
            self.observer.rejected(request, exc.error_type)
            raise
        named = replace(request, adapter=adapter.name if adapter else None)
        return await self._launch(named, adapter)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        stream = await self.start(request)
        try:
            return await collect(stream, request_id=request.request_id, model=request.model)
        finally:
            await stream.aclose()

    async def start_batch(
        self, requests: Sequence[GenerationRequest]
    ) -> AsyncIterator[GenerationEvent]:
        """Start several requests as one stream (a list of prompts, DJL multi-adapter batches).

        Choice indexes are offset so choice i of request k becomes k * n + i; `Started` is taken
        from the first request and `Done` sums the usage.
        """
        streams: list[EventStream] = []
        try:
            for request in requests:
                streams.append(await self.start(request))
        except GatewayError:
            for stream in streams:
                await stream.aclose()
            raise
        return _merge(streams)

    async def generate_batch(self, requests: Sequence[GenerationRequest]) -> GenerationResult:
        events = await self.start_batch(requests)
        return await collect(events, request_id=requests[0].request_id, model=requests[0].model)

    def cancel(self, request_id: str) -> None:
        """stopInfer: abort every running request with this client-visible id."""
        streams = self._active.get(request_id)
        if not streams:
            raise RequestNotFound(f"RequestId is {request_id} not found.")
        for stream in list(streams):
            stream.cancel()

    def abort_all(self, reason: GatewayError) -> int:
        """Drain timeout: end every running request with `reason` (an in-band error) and refuse
        the queued ones with it when they get a slot."""
        self._abort_reason = reason
        streams = [s for group in self._active.values() for s in group]
        for stream in streams:
            stream.cancel(reason)
        return len(streams)

    def is_active(self, request_id: str) -> bool:
        return bool(self._active.get(request_id))

    # ---- internals -----------------------------------------------------------------------
    def _gate(self) -> None:
        if not self.lifecycle.accepting:
            state = self.lifecycle.state.value
            raise ServiceUnavailable(f"The service is not ready (state: {state}).")
        role = self.lifecycle.role
        if not role.admits_requests:
            raise ServiceUnavailable(
                f"This instance has the role {role.value} and takes no new requests from clients."
            )

    async def _acquire(self) -> None:
        await self.admission.acquire()
        if self._abort_reason is not None:
            self.admission.release()
            raise self._abort_reason

    async def _resolve(self, request: GenerationRequest) -> AdapterHandle | None:
        if request.model in self.base_names or not request.model:
            return None
        if request.model not in self.adapters:
            raise ModelNotFound(
                f"The model `{request.model}` does not exist. Valid aliases: "
                f"{', '.join(sorted(self.base_names))}."
            )
        return await self.adapters.acquire(request.model)

    async def _launch(
        self, request: GenerationRequest, adapter: AdapterHandle | None
    ) -> EventStream:
        engine_id = f"{request.request_id}-{next(self._ids)}"
        stream = EventStream(self, request, engine_id, adapter)
        self._active.setdefault(request.request_id, []).append(stream)
        self.observer.admitted(request)
        stream.arm_deadline(request.timeout_s or self.limits.request_timeout_s)
        try:
            await stream.prime()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    def _release_slot(self) -> None:
        self.admission.release()
        self.lifecycle.leave()

    def _finish(
        self, stream: EventStream, adapter: AdapterHandle | None, usage: Usage | None
    ) -> None:
        group = self._active.get(stream.request.request_id, [])
        if stream in group:
            group.remove(stream)
        if not group:
            self._active.pop(stream.request.request_id, None)
        if adapter is not None:
            self.adapters.release(adapter, usage.completion_tokens if usage else 0)
        self._release_slot()
        self.observer.finished(
            stream.request, error_type=stream.error_type, usage=usage, timing=stream.timing
        )


async def _merge(streams: list[EventStream]) -> AsyncIterator[GenerationEvent]:
    """Run several streams concurrently; re-index choices; one Started first, one Done last."""
    queue: asyncio.Queue[tuple[int, GenerationEvent | BaseException | None]] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(k, s, queue)) for k, s in enumerate(streams)]
    offsets = list(itertools.accumulate((s.request.sampling.n for s in streams), initial=0))
    totals = [0, 0]
    remaining = len(streams)
    try:
        while remaining:
            k, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            forwarded = _reindex(item, k, offsets[k], totals)
            if forwarded is not None:
                yield forwarded
        yield Done(usage=Usage(prompt_tokens=totals[0], completion_tokens=totals[1]))
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()


async def _pump(
    k: int,
    stream: EventStream,
    queue: asyncio.Queue[tuple[int, GenerationEvent | BaseException | None]],
) -> None:
    try:
        async for event in stream:
            await queue.put((k, event))
        await queue.put((k, None))
    except BaseException as exc:  # forwarded to the consumer, re-raised there
        await queue.put((k, exc))


def _reindex(
    event: GenerationEvent, k: int, offset: int, totals: list[int]
) -> GenerationEvent | None:
    if isinstance(event, Started):
        return event if k == 0 else None
    if isinstance(event, Done):
        totals[0] += event.usage.prompt_tokens
        totals[1] += event.usage.completion_tokens
        return None
    return replace(event, choice=event.choice + offset)


__all__ = ["EventStream", "FinishReason", "InferenceService", "Limits", "RequestObserver", "Timing"]
