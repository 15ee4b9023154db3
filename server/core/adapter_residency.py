"""Which adapters the engine holds: loading, the LRU eviction of idle unpinned adapters, the
settle delay, and unloading what was retired.

Why residency is managed here and not left to vLLM: vLLM re-reads an adapter it evicted from its
CPU cache inside `generate()`, where a load failure kills the engine core for good. So the registry
validates every adapter on disk (`adapter_files`), lets the engine load it with `add_adapter` (where
a failure is harmless) before any request may use it, and keeps at most `max_cpu_loras` adapters in
the engine so vLLM never evicts on its own. Beyond that the least recently used idle unpinned
adapter is removed and transparently re-validated and re-added on its next use; a request whose
adapter finds every cached place pinned or busy waits for one (bounded by `wait_s`).

Why an adapter stays in the engine a moment after its last request (settling): vLLM may still
run a finished or aborted request's adapter in a step it had already scheduled; an adapter removed
in that window is read back from disk inside that step, which evicts whatever vLLM's own LRU picks,
a pinned adapter included, behind the registry's back (found by running the churn tests in reverse
order). So nothing leaves the engine until it settled: the engine completed `SETTLE_STEPS` steps
since its last request ended, or, when steps are not known (`Engine.steps` does not advance),
`settle_s` passed. Two steps: the step whose outputs ended the request may not be counted yet
when the request ends (vLLM records a step's stats after handing its outputs to the requests),
and the one after it may have been scheduled before the end (an abort or a stop string the
front end found, an engine scheduling a step ahead); any later step was scheduled without it.
The vLLM engine counts steps only with one front end (`workers: 1`): with several, a worker's
abort and the owner's `remove_lora` reach the engine core on different sockets, so there the time
rule alone decides, as before.

Why pins are not passed to the engine: vLLM's `pin_lora` also pins the adapter into an engine
(GPU) slot, but its scheduler still admits up to `max_loras` other adapters per step; the worker
then evicts an adapter of the running batch and fails, killing the engine. A pin here means
"never evicted from the engine's cache", which is what operators ask for, at no risk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from server.core.adapter_catalog import AdapterCatalog
from server.core.adapter_files import READ_ATTEMPTS, AdapterFiles, fingerprint
from server.core.adapter_records import AdapterLimits, AdapterRecord
from server.core.adapter_sources import AdapterSources
from server.core.engine import Engine
from server.core.errors import AdapterInvalid, AdapterNotFound, GatewayError, Overloaded
from server.core.types import AdapterHandle

logger = logging.getLogger("gateway.adapters")

SETTLE_STEPS = 2  # engine steps after an adapter's last request that settle it
SETTLE_POLL_S = 0.002  # how often a wait for settling looks at the engine's step count: a step
# takes a few milliseconds, and a load past the cache waits for its victim to settle


class AdapterResidency:
    def __init__(
        self, *, catalog: AdapterCatalog, engine: Engine, limits: AdapterLimits,
        sources: AdapterSources,
    ) -> None:
        self._catalog = catalog
        self._engine = engine
        self.limits = limits
        self._sources = sources
        self._room = asyncio.Event()  # set (then replaced) whenever a cached place may be free
        self._tasks: set[asyncio.Task[None]] = set()

    async def engine_resident(self) -> set[str]:
        """Names of registered adapters the engine really holds now (asks the engine)."""
        ids = await self._engine.resident_adapters()
        return {r.name for r in self._catalog.by_name.values() if r.handle.int_id in ids}

    # ---- loading -----------------------------------------------------------------------------
    async def wait_resident(
        self, name: str, *, requested: str, cold: bool = False
    ) -> AdapterRecord:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.wait_s
        while True:
            record = self._registered(name, requested)
            if record.resident:
                return record
            # a remote adapter's folder is fetched again here if it was evicted, never under
            # the lock, and held until the engine has read it
            async with self._sources.current(record) as files:
                if await self._wait_for_room(record, files, deadline, requested, cold=cold):
                    return record
            # `name` stands for another record now (its files changed): load that one

    async def _wait_for_room(
        self, record: AdapterRecord, files: AdapterFiles | None, deadline: float,
        requested: str, *, cold: bool,
    ) -> bool:
        """Load `record` once a cached place is free; False if its name stopped naming it."""
        loop = asyncio.get_running_loop()
        while True:
            async with self._catalog.lock:
                if self._registered(record.name, requested) is not record:
                    return False
                if record.resident or await self._load_if_room(record, files, cold=cold):
                    return True
                room = self._room
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise Overloaded(
                    f"No free LoRA slot for adapter {record.name}: all "
                    f"{self.limits.max_cpu_loras} cached adapters are pinned or busy"
                )
            with contextlib.suppress(TimeoutError):  # woken by room, or by an adapter settling
                await asyncio.wait_for(room.wait(), min(remaining, self._settling_in()))

    def _registered(self, name: str, requested: str) -> AdapterRecord:
        record = self._catalog.by_name.get(name)
        if record is None:
            raise AdapterNotFound(f"The model `{requested}` does not exist.")
        return record

    async def prefetch(self, name: str) -> bool:
        """Load `name` ahead of its requests if there is room without waiting (see
        `AdapterRegistry.prefetch`)."""
        record = self._catalog.by_name.get(name)
        if record is None:
            raise AdapterNotFound(f"The adapter `{name}` does not exist.")
        if record.resident:
            return True
        async with self._sources.current(record) as files, self._catalog.lock:
            if self._catalog.by_name.get(name) is not record:
                return True  # changed meanwhile: left to its requests' own load
            if record.resident:
                return True
            if not await self._load_if_room(record, files, ahead=True):
                return False
            record.prefetches += 1
            record.prefetched = True
            self.mark_used(record)  # the most recently used: the last a request's load evicts
            return True

    async def _load_if_room(
        self, record: AdapterRecord, files: AdapterFiles | None, *, cold: bool = False,
        ahead: bool = False,
    ) -> bool:
        """Under the lock: load `record` into the engine (with `files` if they were fetched
        again), evicting an idle adapter if needed (for a load `ahead` of its requests, never
        another adapter loaded ahead). Returns False when every cached place is pinned or
        busy."""
        await self._rebind_if_changed(record, files)
        if record.handle.int_id in self._resident_ids():
            record.resident = True  # the same files are in the engine under another record
            return True
        victim = None
        if len(self._resident_ids()) >= self.limits.max_cpu_loras:
            victim = self._eviction_candidate(spare_prefetched=ahead)
            if victim is None:
                return False
            self._evict(victim)
        started = time.perf_counter()
        try:
            await self._add_as_inspected(record, None if victim is None else victim.handle)
        except GatewayError:
            record.load_failures += 1
            raise
        record.resident = True
        record.count_load(time.perf_counter() - started, cold=cold)
        return True

    async def _add_as_inspected(
        self, record: AdapterRecord, evicting: AdapterHandle | None
    ) -> None:
        """Under the lock: let the engine load `record`'s files, which must still be the ones
        inspected when the engine has read them (else it may hold other weights, or a mix of
        two versions, under this identity): loaded again from a new inspection if they
        changed, refused if they keep changing."""
        for _ in range(READ_ATTEMPTS):
            await self._engine.add_adapter(record.handle, evicting=evicting)
            evicting = None
            if fingerprint(Path(record.handle.path)) == record.fingerprint:
                return
            await self._engine.remove_adapter(record.handle)  # no request has it yet
            await self._rebind_if_changed(record, None)
            if record.handle.int_id in self._resident_ids():
                return  # the new contents are in the engine under another record already
        raise AdapterInvalid(
            f"Adapter {record.name} kept changing while the engine read its files: try again "
            "once they are written"
        )

    async def _rebind_if_changed(self, record: AdapterRecord, files: AdapterFiles | None) -> None:
        """Under the lock, before the engine reads a record that is not in it: if its files
        changed (a local folder's, looked at here; a remote one's, fetched again as `files`),
        it takes the identity of the new contents (nothing refers to the old one)."""
        if files is None:
            if self._sources.is_remote(record.src):
                return  # its held folder is unchanged (AdapterSources.current)
            if fingerprint(Path(record.handle.path)) == record.fingerprint:
                return
            async with self._sources.fetched(record.handle.path) as found:  # local disk only
                files = found
        if files.digest != record.digest:
            record.handle = AdapterHandle(
                name=record.name, int_id=self._catalog.id_for(files.digest),
                path=str(files.path),
            )
            record.digest, record.rank = files.digest, files.rank
        record.fingerprint = files.fingerprint

    # ---- eviction ----------------------------------------------------------------------------
    def _resident_ids(self) -> set[int]:
        return {r.handle.int_id for r in self._catalog.all_records() if r.resident}

    def mark_used(self, record: AdapterRecord) -> None:
        """A request on `record` started or ended: it settles from now."""
        record.last_used = time.monotonic()
        record.last_used_step = self._engine.steps()

    def _settled(self, record: AdapterRecord) -> bool:
        """No request on the engine's copy of `record` (which names for the same files share)
        ended too recently."""
        now, steps, int_id = time.monotonic(), self._engine.steps(), record.handle.int_id
        return all(
            r.last_used <= now - self.limits.settle_s or steps - r.last_used_step >= SETTLE_STEPS
            for r in (record, *self._catalog.all_records()) if r.handle.int_id == int_id
        )

    def _eviction_candidate(self, *, spare_prefetched: bool = False) -> AdapterRecord | None:
        """The least recently used adapter that is idle, unpinned and settled (and not loaded
        ahead, if `spare_prefetched`)."""
        idle = [
            r for r in self._idle_unpinned()
            if self._settled(r) and not (spare_prefetched and r.prefetched)
        ]
        return min(idle, key=lambda r: r.last_used) if idle else None

    def _idle_unpinned(self) -> list[AdapterRecord]:
        busy = {r.handle.int_id for r in self._catalog.all_records() if r.inflight > 0}
        pinned = {r.handle.int_id for r in self._catalog.by_name.values() if r.pin}
        return [
            r for r in self._catalog.all_records()
            if r.resident and r.handle.int_id not in busy | pinned
        ]

    def _settling_in(self) -> float:
        """Seconds until an idle adapter may have settled (the wait is capped by `wait_s`)."""
        idle = self._idle_unpinned()
        return self._next_settle_check(idle) if idle else self.limits.wait_s

    def _next_settle_check(self, records: list[AdapterRecord]) -> float:
        """Seconds until one of `records` settles by time, or until the step count is worth
        looking at again (the engine's steps advance without telling anyone)."""
        oldest = min(r.last_used for r in records)
        return max(min(oldest + self.limits.settle_s - time.monotonic(), SETTLE_POLL_S), 0.001)

    def _evict(self, victim: AdapterRecord) -> None:
        """Mark `victim` gone; the engine removes it as part of the load that replaces it.
        Not resident before the engine is asked: a request arriving meanwhile must not get the
        handle (the engine would read the adapter back inside a step, evicting what its own
        LRU picks, a pinned adapter included), it waits for the lock and loads it again."""
        for record in self._catalog.all_records():
            if record.handle.int_id == victim.handle.int_id and record.resident:
                record.resident = False
                record.evictions += 1
        if victim.removed:
            self._catalog.retired = [r for r in self._catalog.retired if r is not victim]

    # ---- retirement ----------------------------------------------------------------------------
    def retire(self, record: AdapterRecord) -> None:
        """Under the lock: `record` left the catalog; it leaves the engine once its requests
        ended and it settled."""
        record.removed = True
        self._catalog.retired.append(record)
        if record.inflight == 0:
            self.spawn(self.unload_settled(record))

    async def unload_settled(self, record: AdapterRecord) -> None:
        """Remove a retired adapter from the engine once it settled, if it is still idle."""
        while not self._settled(record):  # noqa: ASYNC110 (the engine does not signal steps)
            await asyncio.sleep(self._next_settle_check([record]))
        async with self._catalog.lock:
            if record.inflight == 0:
                await self._unload(record)
            self.signal_room()

    async def _unload(self, record: AdapterRecord) -> None:
        if not record.removed:
            return  # restored by a failed update meanwhile
        self._catalog.retired = [r for r in self._catalog.retired if r is not record]
        if not record.resident:
            return
        record.resident = False
        sharing = [
            r for r in self._catalog.all_records() if r.handle.int_id == record.handle.int_id
        ]
        if sharing:  # the same name and path were registered again: keep the engine copy
            sharing[0].resident = True
            return
        try:
            await self._engine.remove_adapter(record.handle)
        except GatewayError:
            logger.warning("the engine failed to remove adapter %s", record.name, exc_info=True)

    def signal_room(self) -> None:
        self._room.set()
        self._room = asyncio.Event()

    def spawn(self, job: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
