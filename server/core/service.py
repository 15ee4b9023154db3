"""InferenceService: the façade every protocol talks to, and the one place for cross-protocol
policy. Protocols never see the engine: they tokenize, describe the model, check names and
generate through this class.

Generation: lifecycle gate → admission (concurrency + bounded queue served round-robin across
adapters; a batch's prompts are admitted together) → model/adapter resolution → engine (which
fits the tokenized prompt to the context: server/core/budget.py) → an `EventStream` primed up to
its first output, so errors before the first byte raise here and get a real status. Closing the
stream (client gone, stopInfer, drain) aborts the engine request and releases everything it held.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from functools import partial

from server.core.adapters import AdapterRegistry
from server.core.admission import Admission, Limits
from server.core.batch import BatchStream
from server.core.beam_search import BeamSearch
from server.core.collect import collect
from server.core.engine import Engine, OutputParser
from server.core.errors import (
    AdapterNotFound,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    RequestNotFound,
    ServiceUnavailable,
)
from server.core.frozen import replaced
from server.core.json_limits import check_schema_depth
from server.core.lifecycle import Lifecycle
from server.core.overhead import on_engine
from server.core.peers import Peers
from server.core.stream import Deadlines, EventStream, NullObserver, RequestObserver, Timing
from server.core.types import (
    AdapterHandle,
    ChatPrompt,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    ParseSpec,
    SamplingDefaults,
)

CANCEL = "service.cancel"  # the peer operation of `cancel`


class InferenceService:
    def __init__(  # noqa: PLR0913 - the parts it fronts, all built by the assembly
        self,
        *,
        engine: Engine,
        adapters: AdapterRegistry,
        lifecycle: Lifecycle,
        limits: Limits,
        base_names: Sequence[str],
        aliases: Sequence[str] = (),
        admission: Admission | None = None,
        observer: RequestObserver | None = None,
        peers: Peers | None = None,
    ) -> None:
        self._engine = engine
        self.peers = peers or Peers()  # the other workers, for requests that live there
        self.peers.handle(CANCEL, self._cancel_here)
        self.adapters = adapters
        self.lifecycle = lifecycle
        self.limits = limits
        # every name that selects the base model: served names, then configured aliases (names
        # clients send for "the model", e.g. TGI's "tgi"), which no listing shows
        self.base_names = frozenset(base_names) | frozenset(aliases)
        self.aliases = frozenset(aliases) - frozenset(base_names)
        self.served_name = base_names[0]
        self.observer: RequestObserver = observer or NullObserver()
        self.admission = admission or Admission(limits)
        self._active: dict[str, list[EventStream]] = {}
        self._abort_reason: GatewayError | None = None
        self._ids = itertools.count(1)
        timeout = limits.request_timeout_s
        self._deadlines = Deadlines(timeout) if timeout else None  # one timer for them all

    # ---- the model ---------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        return self._engine.info()

    def stats(self) -> EngineStats:
        return self._engine.stats()

    async def check_health(self) -> None:
        """Raise `ServiceUnavailable` if the engine cannot serve."""
        await self._engine.check_health()

    async def tokenize(self, text: str | ChatPrompt, *, add_special_tokens: bool) -> list[int]:
        return await self._engine.tokenize(text, add_special_tokens=add_special_tokens)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """The text of each token on its own."""
        return self._engine.token_texts(token_ids)

    def output_parser(self, spec: ParseSpec) -> OutputParser | None:
        """A fresh parser for one choice's answer (reasoning, auto tool calls), if configured."""
        return self._engine.output_parser(spec)

    def defaults(self) -> SamplingDefaults:
        """The model's sampling defaults, for requests that omit a field."""
        return self._engine.info().defaults

    def knows(self, name: str) -> bool:
        """Whether `name` selects the base model or a registered adapter (or workflow alias)."""
        return not name or name in self.base_names or name in self.adapters

    async def find_model(self, name: str | None) -> None:
        """Raise `ModelNotFound` unless `name` (None or "" = the base model) can be served, for
        requests that generate nothing (tokenize, count tokens). A name only a discovery folder
        or an adapter source may hold is looked up, and registered, as a generation would
        (vLLM's `_check_model` resolves it too)."""
        if not name or name in self.base_names:
            return
        if not self.knows(name):
            raise self._not_found(name)
        try:
            await self.adapters.ensure(name)
        except AdapterNotFound:
            raise self._not_found(name) from None

    # ---- generation --------------------------------------------------------------------------
    async def start(self, request: GenerationRequest) -> EventStream:
        """Admit, resolve, start and prime one request. Raises GatewayError before any output.
        A queued request already counts as in flight, so a drain waits for it too."""
        key = await self._admit((request,))
        return await self._launch(request, key)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """The whole answer. Errors raise before anything was answered, so this needs no
        priming: the events are folded as they come."""
        key = await self._admit((request,))
        stream = await self._launch(request, key, prime=False)
        try:
            return await collect(stream, request_id=request.request_id, model=request.model)
        finally:
            await stream.aclose()

    async def start_batch(self, requests: Sequence[GenerationRequest]) -> BatchStream:
        """Several requests as one stream (a list of prompts, DJL multi-adapter batches): admitted
        together, started and primed concurrently, all closed if any fails to start. Choice i of
        request k becomes k * n + i; every `Started` says its prompt; one `Done` sums the usage."""
        key = await self._admit(requests)
        tasks = [asyncio.ensure_future(self._launch(r, key)) for r in requests]
        batch: BatchStream | None = None
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            streams = await _settle(tasks)
            failure = next(
                (t.exception() for t in tasks if not t.cancelled() and t.exception()), None
            )
            if failure is not None or len(streams) < len(tasks):
                raise failure or asyncio.CancelledError()
            batch = BatchStream(streams)
            return batch
        finally:
            if batch is None:  # failed, or cancelled (the client left): close what did start
                await _close_started(tasks)

    async def generate_batch(self, requests: Sequence[GenerationRequest]) -> GenerationResult:
        events = await self.start_batch(requests)
        try:
            return await collect(events, request_id=requests[0].request_id, model=requests[0].model)
        finally:
            await events.aclose()

    async def cancel(self, request_id: str) -> None:
        """stopInfer: abort every running request with this client-visible id, here or in
        another worker."""
        if await self._cancel_here(request_id):
            return
        if not any(await self.peers.ask(CANCEL, request_id)):
            raise RequestNotFound(f"RequestId is {request_id} not found.")

    async def _cancel_here(self, request_id: str) -> bool:
        streams = self._active.get(request_id)
        for stream in list(streams or ()):
            stream.cancel()
        return bool(streams)

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

    # ---- internals ---------------------------------------------------------------------------
    async def _admit(self, requests: Sequence[GenerationRequest]) -> str:
        """Gate and admission for all of `requests` at once; each then holds one slot. A batch
        waits in the queue of its first request's adapter (and holds that adapter's slot).
        Returns the queue key, which each request's release names."""
        count = len(requests)
        key = self._queue_key(requests[0])
        try:
            for request in requests:
                _check_structured(request)
            if count > 1:
                self._check_batch_fits(requests)
            self._gate()
            self.lifecycle.enter(count)
            try:
                if not self.admission.try_acquire(count, key):
                    await on_engine(self.admission.acquire(count, key))
                if self._abort_reason is not None:
                    self.admission.release(count, key)
                    raise self._abort_reason
            except BaseException:
                self.lifecycle.leave(count)
                raise
        except GatewayError as exc:
            for request in requests:
                self.observer.rejected(request, exc.error_type)
            raise
        return key

    def _check_batch_fits(self, requests: Sequence[GenerationRequest]) -> None:
        """A batch runs together, so its adapters must all be in the engine at once: refuse one
        that names more than the engine can hold besides the pinned adapters it does not name
        (it would wait for room that never comes, holding the places it got)."""
        limits = self.adapters.limits
        if not limits.enabled:
            return
        adapters = {self._queue_key(r) for r in requests} - {""}
        pinned = {r.name for r in self.adapters.records() if r.pin} - adapters
        places = limits.max_cpu_loras - len(pinned)
        if len(adapters) > places:
            held = f", {len(pinned)} of them pinned to other adapters" if pinned else ""
            raise InvalidRequest(
                f"This batch names {len(adapters)} distinct adapters, but the engine holds at "
                f"most {limits.max_cpu_loras} at once (maxCpuLoras{held}): send "
                f"at most {places} per request.",
                param="adapters",
            )

    def _queue_key(self, request: GenerationRequest) -> str:
        """The admission queue a request waits in: its adapter's registered name (a workflow
        alias shares its adapter's), "" for the base model; an unknown name (refused once
        admitted) its own; a composition its adapters' names joined by "+" (never a name)."""
        if request.merge is not None:
            return "+".join(self.adapters.canonical(n) for n in request.merge.ids)
        name = request.model
        if not name or name in self.base_names:
            return ""
        return self.adapters.canonical(name)

    def _gate(self) -> None:
        if not self.lifecycle.admitting:
            state = self.lifecycle.state.value
            raise ServiceUnavailable(f"The service is not ready (state: {state}).")
        role = self.lifecycle.role
        if not role.admits_requests:
            raise ServiceUnavailable(
                f"This instance has the role {role.value} and takes no new requests from clients."
            )

    async def _launch(
        self, request: GenerationRequest, key: str, *, prime: bool = True
    ) -> EventStream:
        """Resolve and start one admitted request (it holds one slot of queue `key` until
        closed)."""
        adapter: AdapterHandle | None = None
        try:
            adapter = await self._resolve(request)
        except BaseException as exc:
            if adapter is not None:
                self.adapters.release(adapter)
            self._release_slot(key)
            if isinstance(exc, GatewayError):
                self.observer.rejected(request, exc.error_type)
            raise
        if adapter is not None:
            request = replaced(request, adapter=adapter.name)
        engine_id = f"{request.request_id}-{next(self._ids)}"
        if request.sampling.beam_search:
            search = BeamSearch(self._engine, request, engine_id, adapter)
            events, abort = search.events(), search.abort
        else:
            events = self._engine.generate(request, engine_id, adapter)
            abort = partial(self._engine.abort, engine_id)
        stream = EventStream(
            request,
            events,
            engine_id=engine_id,
            adapter=adapter,
            abort=abort,
            observer=self.observer,
            on_close=partial(self._closed, key),
        )
        self._active.setdefault(request.request_id, []).append(stream)
        self.observer.admitted(request)
        if request.timeout_s or self._deadlines is None:
            stream.arm_deadline(request.timeout_s)
        else:
            self._deadlines.add(stream)
        if not prime:
            return stream
        try:
            await stream.prime()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def _resolve(self, request: GenerationRequest) -> AdapterHandle | None:
        if request.merge is not None:
            if request.model and request.model not in self.base_names:
                raise InvalidRequest(
                    f"merged_adapters composes adapters on the base model: `model` must be the "
                    f"base model ({self.served_name}), not `{request.model}`",
                    param="merged_adapters",
                )
            return await on_engine(self.adapters.acquire_merged(request.merge))
        if not request.model or request.model in self.base_names:
            return None
        if request.model not in self.adapters:
            raise self._not_found(request.model)
        return await on_engine(self.adapters.acquire(request.model))

    def _not_found(self, name: str) -> ModelNotFound:
        return ModelNotFound(
            f"The model `{name}` does not exist. Valid aliases: "
            f"{', '.join(sorted(self.base_names - self.aliases))}."
        )

    def _release_slot(self, key: str) -> None:
        self.admission.release(1, key)
        self.lifecycle.leave()

    def _closed(self, key: str, stream: EventStream) -> None:
        """`on_close` of every stream: forget it, release what it held, report it."""
        group = self._active.get(stream.request.request_id, [])
        if stream in group:
            group.remove(stream)
        if not group:
            self._active.pop(stream.request.request_id, None)
        usage = stream.usage
        if stream.adapter is not None:
            self.adapters.release(stream.adapter, usage.completion_tokens if usage else 0)
        self._release_slot(key)
        self.observer.finished(
            stream.request, error_type=stream.error_type, usage=usage, timing=stream.timing
        )


def _check_structured(request: GenerationRequest) -> None:
    """One schema depth rule for every protocol and every way a schema reaches the engine."""
    structured = request.sampling.structured
    if structured is not None and structured.json_schema is not None:
        check_schema_depth(structured.json_schema)


async def _close_started(tasks: Sequence[asyncio.Future[EventStream]]) -> None:
    """Close the streams of `tasks` that started, in a task of its own that a second cancel of
    the caller cannot interrupt (what it holds would stay held for good)."""
    async def close() -> None:
        for stream in await _settle(tasks):
            await stream.aclose()

    closing = asyncio.ensure_future(close())
    _CLOSING.add(closing)
    closing.add_done_callback(_CLOSING.discard)
    await asyncio.shield(closing)


_CLOSING: set[asyncio.Future[None]] = set()  # clean-ups running: kept from the collector


async def _settle(tasks: Sequence[asyncio.Future[EventStream]]) -> list[EventStream]:
    """Cancel what is still running and return the streams that did start."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return [t.result() for t in tasks if not t.cancelled() and t.exception() is None]


__all__ = ["EventStream", "InferenceService", "Limits", "RequestObserver", "Timing"]
