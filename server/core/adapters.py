"""The one adapter registry behind every protocol and every management route.

It owns the adapters' names, sources, stable integer ids, options, pins, aliases (DJL workflows)
and their residency in the engine, and it is the only code that adds adapters to or removes them
from the engine. A management change is written to the state file (`adapter_state`) before it
becomes visible, so one that cannot be made durable is refused having changed nothing.

Why residency is managed here and not left to vLLM: vLLM re-reads an adapter it evicted from its
CPU cache inside `generate()`, where a load failure kills the engine core for good. So the registry
validates every adapter on disk (`adapter_files`), lets the engine load it with `add_adapter` (where
a failure is harmless) before any request may use it, and keeps at most `max_cpu_loras` adapters in
the engine so vLLM never evicts on its own. Beyond that the least recently used idle unpinned
adapter is removed and transparently re-validated and re-added on its next use; a request whose
adapter finds every cached place pinned or busy waits for one (bounded by `wait_s`).

Why an adapter stays in the engine a moment after its last request (`settle_s`): vLLM may still
run a finished request's adapter in a step it had already scheduled; an adapter removed in that
window is read back from disk inside that step, which evicts whatever vLLM's own LRU picks, a
pinned adapter included, behind the registry's back (found by running the churn tests in reverse
order). So nothing leaves the engine until `settle_s` after its last request ended.

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
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from server.core.adapter_files import (
    NAME_PATTERN,
    AdapterFiles,
    AdapterRules,
    Fingerprint,
    check_name,
    fingerprint,
    inspect_adapter,
)
from server.core.adapter_sources import AdapterFetcher
from server.core.adapter_state import AdapterJournal, SavedAdapter
from server.core.composition import MERGED_ORIGIN, Composition
from server.core.engine import Engine
from server.core.errors import (
    AdapterCapacity,
    AdapterExists,
    AdapterInvalid,
    AdapterNotFound,
    AdapterSourceMissing,
    GatewayError,
    LoraDisabled,
    Overloaded,
)
from server.core.types import AdapterHandle, AdapterMerge

logger = logging.getLogger("gateway.adapters")


# Upper bounds (seconds) of the load-latency histogram (validation + the engine's add_adapter).
LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Residency(StrEnum):
    """Where an adapter is. ENGINE_SLOT: it has requests in the engine (in a slot or queued
    for one); CPU_CACHE: loaded in the engine's cache, idle; REGISTERED: known, not loaded."""

    ENGINE_SLOT = "engine_slot"
    CPU_CACHE = "cpu_cache"
    REGISTERED = "registered"


@dataclass(slots=True, kw_only=True)
class AdapterRecord:
    name: str
    src: str  # as the operator gave it
    handle: AdapterHandle  # handle.path is the resolved directory
    rank: int
    preload: bool = True
    pin: bool = False
    options: dict[str, str] = field(default_factory=dict)
    alias: str | None = None  # display alias (X-Amzn-SageMaker-Adapter-Alias)
    # api: a management call; config: the config file; folder: adapterDir; merged: composed
    # for requests (server/core/composition.py: never listed, never named by a request)
    origin: str = "api"
    digest: str = ""  # of the files: the engine identity (handle.int_id) follows it
    fingerprint: Fingerprint = ()  # stat of the files when digested
    resident: bool = False
    removed: bool = False
    inflight: int = 0
    registered_at: float = field(default_factory=time.time)
    last_used: float = 0.0
    requests: int = 0
    generated_tokens: int = 0
    loads: int = 0
    cold_loads: int = 0  # loads a request waited for (not a preload)
    evictions: int = 0
    load_failures: int = 0
    load_buckets: list[int] = field(default_factory=lambda: [0] * len(LOAD_BUCKETS))
    load_seconds: float = 0.0  # total time of the loads

    @property
    def residency(self) -> Residency:
        if not self.resident:
            return Residency.REGISTERED
        return Residency.ENGINE_SLOT if self.inflight > 0 else Residency.CPU_CACHE

    @property
    def display_name(self) -> str:
        return self.alias or self.name

    def snapshot(self) -> AdapterSnapshot:
        return AdapterSnapshot(
            name=self.name, int_id=self.handle.int_id, residency=self.residency, pinned=self.pin,
            rank=self.rank, inflight=self.inflight, requests=self.requests,
            generated_tokens=self.generated_tokens, loads=self.loads, evictions=self.evictions,
            load_failures=self.load_failures, last_used=self.last_used,
            cold_loads=self.cold_loads, load_buckets=tuple(self.load_buckets),
            load_seconds=self.load_seconds,
        )

    def count_load(self, seconds: float, *, cold: bool) -> None:
        self.loads += 1
        self.cold_loads += cold
        self.load_seconds += seconds
        for index, bound in enumerate(LOAD_BUCKETS):
            if seconds <= bound:
                self.load_buckets[index] += 1


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistryView:
    """A registry's names, aliases and refusals, as another worker process shows them."""

    records: tuple[AdapterRecord, ...]
    aliases: dict[str, str]
    failed: dict[str, Failure]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterSnapshot:
    """Per-adapter numbers for metrics (counters are totals since registration)."""

    name: str
    int_id: int
    residency: Residency
    pinned: bool
    rank: int
    inflight: int
    requests: int
    generated_tokens: int
    loads: int
    evictions: int
    load_failures: int
    last_used: float  # time.monotonic() of the last request, 0.0 if never used
    cold_loads: int = 0
    load_buckets: tuple[int, ...] = ()  # cumulative counts per LOAD_BUCKETS bound
    load_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Failure:
    """A folder adapter that was refused: why, and the files' state then (a change retries)."""

    path: str
    reason: str
    fingerprint: Fingerprint


@dataclass(frozen=True, slots=True)
class SyncReport:
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    reloaded: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterLimits:
    enabled: bool
    max_loras: int  # engine slots: distinct adapters in one engine step (vLLM enforces it)
    max_cpu_loras: int  # adapters held in the engine at once (this registry enforces it)
    wait_s: float = 60.0  # how long a request waits for a free cached place
    settle_s: float = 0.25  # an adapter stays in the engine this long after its last request
    # folders whose sub-directories are adapters by name: served on first request and kept in
    # sync by `sync_folders` (adapterDir, then the model folder's adapters/); () = off
    discovery_dirs: tuple[str, ...] = ()
    on_demand: bool = True  # a request may name a folder of them that is not registered yet

    @property
    def max_pins(self) -> int:
        """Pins may take at most `max_loras` places and must leave one for unpinned adapters."""
        return max(0, min(self.max_loras, self.max_cpu_loras - 1))


class AdapterRegistry:
    def __init__(  # noqa: PLR0913 - its parts, all passed in when built
        self, *, engine: Engine, rules: AdapterRules, limits: AdapterLimits,
        state_file: Path | None = None,
        fetcher: AdapterFetcher | None = None,
        composition: Composition | None = None,
        on_change: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._engine = engine
        self._fetcher = fetcher  # brings remote sources (s3://, https://, hf://) to local folders
        # where management-API registrations are kept; read before the engine started, so a
        # damaged file has stopped the start already (server.gateway.saved_adapters)
        self._journal = None if state_file is None else AdapterJournal(state_file)
        if self._journal is not None:
            self._journal.load()
        self.rules = rules
        self.limits = limits
        self._records: dict[str, AdapterRecord] = {}
        self._aliases: dict[str, str] = {}  # alias (DJL workflow name) -> adapter name
        self._retired: list[AdapterRecord] = []  # unregistered or replaced, still in use/loaded
        self._ids: dict[str, int] = {}  # content digest -> engine id (same files, same slot)
        self._next_id = 1
        self._failed: dict[str, Failure] = {}  # folder adapters refused, until their files change
        self._discovering: dict[str, asyncio.Future[None]] = {}  # first requests load once
        self._lock = asyncio.Lock()  # serialises changes of the registry and of the engine
        self._room = asyncio.Event()  # set (then replaced) whenever a cached place may be free
        self._tasks: set[asyncio.Task[None]] = set()
        # awaited after every change of names, sources, pins or refusals, before the change is
        # answered: how the other worker processes see it (server.runtime.worker_link.py)
        self.on_change = on_change
        self.composition = composition  # None: requests may not compose adapters

    # ---- queries ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Registered adapter names, in registration order (composed ones are not listed)."""
        return [r.name for r in self.records()]

    def records(self) -> list[AdapterRecord]:
        return [r for r in self._records.values() if r.origin != MERGED_ORIGIN]

    def merged_records(self) -> list[AdapterRecord]:
        """The composed adapters registered now (server/core/composition.py)."""
        return [r for r in self._records.values() if r.origin == MERGED_ORIGIN]

    def is_merged(self, name: str) -> bool:
        """Whether `name` is a composed adapter registered now."""
        record = self._records.get(name)
        return record is not None and record.origin == MERGED_ORIGIN

    def paths_in_use(self) -> set[str]:
        """The folders of every adapter registered, or unregistered but still in the engine."""
        return {r.handle.path for r in self._all_records()}

    def get(self, name: str) -> AdapterRecord:
        record = self._records.get(name)
        if record is None:
            raise AdapterNotFound(f"The adapter {name} was not found", param="name")
        return record

    def resolve(self, name: str) -> AdapterRecord:
        """The record for an adapter name or an alias of one. Raises AdapterNotFound."""
        return self.get(self._aliases.get(name, name))

    def __contains__(self, name: object) -> bool:
        """Registered, an alias, or a folder under a discovery dir (served on first use)."""
        if not isinstance(name, str):
            return False
        record = self._records.get(self._aliases.get(name, name))
        if record is not None:
            return record.origin != MERGED_ORIGIN
        return self.found(name) is not None or self._may_fetch(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.records())

    def found(self, name: str) -> Path | None:
        """The folder named `name` in the first discovery dir that has one, if any."""
        if not self.limits.on_demand or not NAME_PATTERN.match(name):
            return None
        if name in self.rules.base_names:
            return None
        for folder in self.limits.discovery_dirs:
            candidate = Path(folder) / name
            if candidate.is_dir():
                return candidate
        return None

    def _may_fetch(self, name: str) -> bool:
        """Whether a request's unknown `name` is looked up in `adapterSources` (on first use)."""
        return (
            self._fetcher is not None and bool(self._fetcher.prefixes) and self.limits.on_demand
            and bool(NAME_PATTERN.match(name)) and name not in self.rules.base_names
        )

    def failures(self) -> dict[str, Failure]:
        """Folder adapters that were refused, with the reason (shown by describe)."""
        return dict(self._failed)

    def canonical(self, name: str) -> str:
        """The adapter name an alias stands for; any other name as given (even unknown)."""
        return self._aliases.get(name, name)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def snapshots(self) -> list[AdapterSnapshot]:
        return [record.snapshot() for record in self._records.values()]

    async def refresh(self) -> None:
        """Bring records' numbers and residency up to date before showing them (a mirror
        asks the owner; the owner's are always current)."""

    def view(self) -> RegistryView:
        """What other workers need to route and list adapters as this registry does."""
        return RegistryView(
            records=tuple(self._records.values()), aliases=dict(self._aliases),
            failed=dict(self._failed),
        )

    def show(self, view: RegistryView) -> None:
        """Take another registry's view as this one's names, aliases and refusals."""
        self._records = {record.name: record for record in view.records}
        self._aliases = dict(view.aliases)
        self._failed = dict(view.failed)

    async def engine_resident(self) -> set[str]:
        """Names of registered adapters the engine really holds now (asks the engine)."""
        ids = await self._engine.resident_adapters()
        return {r.name for r in self._records.values() if r.handle.int_id in ids}

    # ---- management ------------------------------------------------------------------------
    async def register(  # noqa: PLR0913 - DJL's registration fields, each optional
        self,
        name: object,
        src: object,
        *,
        preload: bool = True,
        pin: bool = False,
        options: Mapping[str, str] | None = None,
        alias: str | None = None,
        origin: str = "api",
    ) -> AdapterRecord:
        """Validate and add an adapter; load it now if `preload` or `pin`.

        Raises LoraDisabled, InvalidRequest/AdapterInvalid (bad name, path or files: the engine
        never saw them), AdapterExists, AdapterCapacity (no room for another pin), StateNotSaved
        (the state file cannot be written: nothing changed).
        """
        self._check_enabled()
        checked = check_name(name, self.rules)
        _check_pin_options(preload=preload, pin=pin)
        self._check_free(checked)
        files = await self._inspect(src)
        async with self._lock:
            self._check_free(checked)
            if pin:
                self._check_pin_capacity()
            record = self._new_record(checked, src, files, preload=preload, pin=pin,
                                      options=options)
            record.alias, record.origin = alias, origin
            # durable before anyone sees it (only management registrations are kept)
            await self._save(checked, _saved(record), strict=origin == "api")
            self._records[checked] = record
            self._failed.pop(checked, None)
        try:
            if preload or pin:
                await self._load_new(record)
        finally:
            await self._changed()
        return record

    async def update(
        self,
        name: str,
        *,
        src: object = None,
        preload: bool | None = None,
        pin: bool | None = None,
        options: Mapping[str, str] | None = None,
    ) -> AdapterRecord:
        """Change source, preload, pin or options. A failed validation leaves it unchanged."""
        self._check_enabled()
        self.get(name)
        files = None if src is None else await self._inspect(src)
        async with self._lock:
            old = self.get(name)
            new_pin = old.pin if pin is None else pin
            new_preload = (old.preload or new_pin) if preload is None else preload
            _check_pin_options(preload=new_preload, pin=new_pin)
            if new_pin and not old.pin:
                self._check_pin_capacity()
            merged = {**old.options, **(options or {})}
            new_src = old.src if src is None else str(src)
            saved = SavedAdapter(name, new_src, new_pin, new_preload, merged)
            kept = old.origin == "api"
            await self._save(name, saved if kept else None, strict=kept)
            was_pinned = old.pin
            record = self._updated(
                old, src, files, preload=new_preload, pin=new_pin, options=merged
            )
        try:
            if (record.preload or record.pin) and not record.resident:
                await self._load_new(record, previous=old, was_pinned=was_pinned)
        finally:
            await self._changed()
        return record

    async def unregister(self, name: str) -> AdapterRecord:
        """Forget the name now and remove the adapter from the engine; if requests are still
        running on it, they finish first and the engine copy goes when the last one ends."""
        async with self._lock:
            record = self.get(name)
            await self._save(name, None, strict=record.origin == "api")
            del self._records[name]
            record.removed = True
            self._retired.append(record)
        await self._changed()
        if record.inflight == 0:
            await self._unload_settled(record)
        return record

    async def resave(self, name: str) -> None:
        """Make the state file's entry for `name` what the registry has now (at start, a saved
        registration that could not be registered again leaves the file as it left the lists)."""
        async with self._lock:
            await self._resave(name)

    def add_alias(self, alias: str, target: str) -> None:
        """Let `alias` (a DJL workflow name) select adapter `target` in every protocol."""
        checked = check_name(alias, self.rules)
        if checked in self._records or checked in self._aliases:
            raise AdapterExists(f"The name {checked} is already used by an adapter or workflow")
        self.get(target)
        self._aliases[checked] = target

    # ---- request path --------------------------------------------------------------------
    async def acquire(self, name: str) -> AdapterHandle:
        """The handle of a loaded adapter, counted as in use until `release`.

        Loads the adapter first if it is not in the engine (waiting for a free cached place if
        all are pinned or busy). Raises AdapterNotFound, AdapterInvalid, Overloaded.
        """
        target = self._aliases.get(name, name)
        record = self._records.get(target)
        if record is None:
            await self._discover(target, requested=name)
            record = self._records.get(target)
            if record is None:
                raise AdapterNotFound(f"The model `{name}` does not exist.")
        if record.resident and fingerprint(Path(record.handle.path)) != record.fingerprint:
            record = await self.reload_changed(record.name)  # never serve replaced weights
        if not record.resident:
            record = await self._wait_resident(target, requested=name, cold=True)
        record.inflight += 1
        record.requests += 1
        record.last_used = time.monotonic()
        return record.handle

    async def compose(self, merge: AdapterMerge) -> str:
        """The registered name of the adapter `merge` composes (composed and registered first
        when new). Raises LoraDisabled, AdapterNotFound, AdapterInvalid, InvalidRequest."""
        self._check_enabled()
        if self.composition is None:
            raise LoraDisabled("Merging adapters is not enabled on this server.")
        return await self.composition.compose(self, merge)

    async def acquire_merged(self, merge: AdapterMerge) -> AdapterHandle:
        """`acquire` of the adapter `merge` composes; composed again if it was unregistered
        (evicted by another composition) between the two steps."""
        try:
            return await self.acquire(await self.compose(merge))
        except AdapterNotFound:
            return await self.acquire(await self.compose(merge))

    async def ensure(self, name: str) -> AdapterRecord:
        """The record of a registered adapter (or alias), registering an adapter folder on its
        first use. Composed adapters are not found. Raises AdapterNotFound."""
        if name not in self:
            raise AdapterNotFound(f"The adapter `{name}` does not exist.", param="merged_adapters")
        target = self._aliases.get(name, name)
        if target not in self._records:
            await self._discover(target, requested=name)
        return self.get(target)

    def release(self, handle: AdapterHandle, generated_tokens: int = 0) -> None:
        record = self._find(handle)
        if record is None:
            return
        record.inflight = max(0, record.inflight - 1)
        record.generated_tokens += generated_tokens
        record.last_used = time.monotonic()
        if record.inflight == 0:
            self._signal_room()
            if record.removed:
                self._spawn(self._unload_settled(record))

    # ---- discovery and contents ----------------------------------------------------------
    async def _discover(self, name: str, *, requested: str) -> None:
        """Register the folder `name` of a discovery dir on its first request; concurrent first
        requests share one registration. A refused folder stays refused (AdapterInvalid with
        its reason) until its files change. Raises AdapterNotFound when there is no folder."""
        path = self.found(name)
        if path is None and not self._may_fetch(name):
            raise AdapterNotFound(f"The model `{requested}` does not exist.")
        if path is not None and (failure := self._still_refused(name, path)) is not None:
            raise AdapterInvalid(failure.reason, param="model")
        pending = self._discovering.get(name)
        if pending is None:
            found = self._register_found(name, path) if path else self._register_remote(name)
            pending = asyncio.ensure_future(found)
            self._discovering[name] = pending
            pending.add_done_callback(lambda _: self._discovering.pop(name, None))
        await asyncio.shield(pending)

    def _still_refused(self, name: str, path: Path) -> Failure | None:
        """The refusal of this folder, unless its files changed since (then it is retried)."""
        failure = self._failed.get(name)
        if failure is None or failure.fingerprint != fingerprint(path):
            return None
        return failure

    async def _register_found(self, name: str, path: Path) -> None:
        try:
            await self.register(name, str(path), preload=False, origin="folder")
        except AdapterExists:
            return  # registered meanwhile (a management call or a folder scan)
        except GatewayError as exc:
            self._failed[name] = Failure(str(path), exc.message, fingerprint(path))
            logger.error("adapter folder %s refused: %s", path, exc.message)
            await self._changed()
            raise
        logger.info("adapter %s registered from its folder %s", name, path)

    async def _register_remote(self, name: str) -> None:
        """Register `name` from the first `adapterSources` prefix that has it."""
        assert self._fetcher is not None
        for prefix in self._fetcher.prefixes:
            src = prefix.replace("{name}", name) if "{name}" in prefix else prefix + name
            try:
                await self.register(name, src, preload=False, origin="source")
            except AdapterSourceMissing:
                continue
            except AdapterExists:
                return  # registered meanwhile
            logger.info("adapter %s registered from %s", name, src)
            return
        raise AdapterNotFound(f"The model `{name}` does not exist.")

    async def reload_changed(self, name: str) -> AdapterRecord:
        """Re-read an adapter whose files changed on disk: same contents, same record; other
        contents, a new record with a new engine identity (the old one finishes its requests
        and leaves). Raises AdapterInvalid if the files are no longer a valid adapter."""
        async with self._lock:
            old = self.get(name)
            files = await self._inspect(self._source_of(old))
            if files.digest == old.digest:
                old.fingerprint = files.fingerprint
                return old
            record = self._updated(
                old, old.src, files, preload=old.preload, pin=old.pin, options=old.options
            )
        logger.info("adapter %s reloaded: its files changed", name)
        try:
            if record.preload or record.pin:
                await self._load_new(record)
        finally:
            await self._changed()
        return record

    async def _rebind_if_changed(self, record: AdapterRecord) -> None:
        """Under the lock, before the engine reads a record that is not in it: if its files
        changed, it takes the identity of the new contents (nothing refers to the old one)."""
        path = Path(record.handle.path)
        if fingerprint(path) == record.fingerprint:
            return
        files = await self._inspect(self._source_of(record))
        if files.digest != record.digest:
            record.handle = AdapterHandle(
                name=record.name, int_id=self._id_for(files.digest), path=str(files.path)
            )
            record.digest, record.rank = files.digest, files.rank
        record.fingerprint = files.fingerprint

    async def sync_folders(self) -> SyncReport:
        """One rescan of the discovery dirs: new folders registered (served on first request),
        folders gone unregistered (their running requests finish), changed files reloaded."""
        present = self._folders()
        added, failed, removed, reloaded = [], [], [], []
        for name, path in present.items():
            if name in self._records or name in self._aliases:
                continue
            if self._still_refused(name, path) is not None:
                continue
            try:
                await self._register_found(name, path)
                added.append(name)
            except GatewayError:
                failed.append(name)
        gone = [n for n in self._failed if n not in present]
        for name in gone:
            del self._failed[name]
        if gone:
            await self._changed()
        for record in list(self._records.values()):
            # the record's own folder, looked at now: one registered by a request during this
            # scan is not in `present`, yet its folder is there
            if record.origin == "folder" and _folder_gone(record):
                with contextlib.suppress(AdapterNotFound):  # unregistered meanwhile
                    await self.unregister(record.name)
                    removed.append(record.name)
            elif fingerprint(Path(record.handle.path)) != record.fingerprint and (
                await self._reloaded(record.name)
            ):
                reloaded.append(record.name)
        return SyncReport(tuple(added), tuple(removed), tuple(reloaded), tuple(failed))

    async def _reloaded(self, name: str) -> bool:
        try:
            before = self.get(name)
            return await self.reload_changed(name) is not before
        except GatewayError as exc:
            logger.error("adapter %s: its changed files are refused: %s", name, exc.message)
            return False

    def _folders(self) -> dict[str, Path]:
        """name -> folder over the discovery dirs; the first dir wins a name both have."""
        found: dict[str, Path] = {}
        for folder in self.limits.discovery_dirs:
            with contextlib.suppress(OSError):
                for entry in sorted(Path(folder).iterdir()):
                    if entry.is_dir() and NAME_PATTERN.match(entry.name):
                        found.setdefault(entry.name, entry)
        return {n: p for n, p in found.items() if n not in self.rules.base_names}

    async def watch_folders(self, interval_s: float) -> None:
        """Rescan every `interval_s` seconds until cancelled; a failed scan is logged."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                report = await self.sync_folders()
            except Exception:
                logger.exception("adapter folder scan failed")
                continue
            if report.added or report.removed or report.reloaded:
                logger.info("adapter folders: %s", report)

    # ---- residency ---------------------------------------------------------------------------
    async def _wait_resident(
        self, name: str, *, requested: str, cold: bool = False
    ) -> AdapterRecord:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.wait_s
        while True:
            async with self._lock:
                record = self._records.get(name)
                if record is None:
                    raise AdapterNotFound(f"The model `{requested}` does not exist.")
                if record.resident or await self._load_if_room(record, cold=cold):
                    return record
                room = self._room
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise Overloaded(
                    f"No free LoRA slot for adapter {name}: all {self.limits.max_cpu_loras} "
                    "cached adapters are pinned or busy"
                )
            with contextlib.suppress(TimeoutError):  # woken by room, or by an adapter settling
                await asyncio.wait_for(room.wait(), min(remaining, self._settling_in()))

    async def _load_if_room(self, record: AdapterRecord, *, cold: bool = False) -> bool:
        """Under the lock: load `record` into the engine, evicting an idle adapter if needed.
        Returns False when every cached place is pinned or busy."""
        await self._rebind_if_changed(record)
        if record.handle.int_id in self._resident_ids():
            record.resident = True  # the same files are in the engine under another record
            return True
        if len(self._resident_ids()) >= self.limits.max_cpu_loras:
            victim = self._eviction_candidate()
            if victim is None:
                return False
            await self._evict(victim)
        started = time.perf_counter()
        try:
            await self._engine.add_adapter(record.handle)
        except GatewayError:
            record.load_failures += 1
            raise
        record.resident = True
        record.count_load(time.perf_counter() - started, cold=cold)
        return True

    async def _load_new(
        self, record: AdapterRecord, *, previous: AdapterRecord | None = None,
        was_pinned: bool = False,
    ) -> None:
        """Load a just registered or updated adapter; undo the change if that fails."""
        try:
            await self._wait_resident(record.name, requested=record.name)
        except Overloaded:
            if not record.pin or (was_pinned and previous is record):
                return  # preload is best effort: it loads on first use
            await self._undo(record, previous, was_pinned=was_pinned)
            raise AdapterCapacity(
                f"No free lora slots: every cached adapter is pinned or busy, so adapter "
                f"{record.name} cannot be pinned now"
            ) from None
        except GatewayError:
            await self._undo(record, previous, was_pinned=was_pinned)
            raise

    async def _undo(
        self, record: AdapterRecord, previous: AdapterRecord | None, *, was_pinned: bool
    ) -> None:
        async with self._lock:
            if previous is record:
                record.pin = was_pinned
            elif self._records.get(record.name) is not record:
                return  # changed again meanwhile: leave the newer state alone
            else:
                del self._records[record.name]
                if previous is not None:  # an update that moved the source: restore the old one
                    previous.removed = False
                    self._retired = [r for r in self._retired if r is not previous]
                    self._records[record.name] = previous
                self._retire(record)
            await self._resave(record.name)

    def _resident_ids(self) -> set[int]:
        return {r.handle.int_id for r in self._all_records() if r.resident}

    def _eviction_candidate(self) -> AdapterRecord | None:
        """The least recently used adapter that is idle, unpinned and settled."""
        settled_before = time.monotonic() - self.limits.settle_s
        idle = [r for r in self._idle_unpinned() if r.last_used <= settled_before]
        return min(idle, key=lambda r: r.last_used) if idle else None

    def _idle_unpinned(self) -> list[AdapterRecord]:
        busy = {r.handle.int_id for r in self._all_records() if r.inflight > 0}
        pinned = {r.handle.int_id for r in self._records.values() if r.pin}
        return [
            r for r in self._all_records()
            if r.resident and r.handle.int_id not in busy | pinned
        ]

    def _settling_in(self) -> float:
        """Seconds until the next idle adapter settles (the wait is capped by `wait_s`)."""
        idle = self._idle_unpinned()
        if not idle:
            return self.limits.wait_s
        oldest = min(r.last_used for r in idle)
        return max(oldest + self.limits.settle_s - time.monotonic(), 0.001)

    async def _evict(self, victim: AdapterRecord) -> None:
        try:
            await self._engine.remove_adapter(victim.handle)
        except GatewayError:
            logger.warning("the engine failed to remove adapter %s", victim.name, exc_info=True)
        for record in self._all_records():
            if record.handle.int_id == victim.handle.int_id and record.resident:
                record.resident = False
                record.evictions += 1
        if victim.removed:
            self._retired = [r for r in self._retired if r is not victim]

    # ---- retirement ----------------------------------------------------------------------------
    def _retire(self, record: AdapterRecord) -> None:
        """Under the lock: `record` left `_records`; it leaves the engine once its requests
        ended and it settled."""
        record.removed = True
        self._retired.append(record)
        if record.inflight == 0:
            self._spawn(self._unload_settled(record))

    async def _unload_settled(self, record: AdapterRecord) -> None:
        """Remove a retired adapter from the engine once it settled, if it is still idle."""
        wait = record.last_used + self.limits.settle_s - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        async with self._lock:
            if record.inflight == 0:
                await self._unload(record)
            self._signal_room()

    async def _unload(self, record: AdapterRecord) -> None:
        if not record.removed:
            return  # restored by a failed update meanwhile
        self._retired = [r for r in self._retired if r is not record]
        if not record.resident:
            return
        record.resident = False
        sharing = [r for r in self._all_records() if r.handle.int_id == record.handle.int_id]
        if sharing:  # the same name and path were registered again: keep the engine copy
            sharing[0].resident = True
            return
        try:
            await self._engine.remove_adapter(record.handle)
        except GatewayError:
            logger.warning("the engine failed to remove adapter %s", record.name, exc_info=True)

    # ---- internals -----------------------------------------------------------------------------
    async def _save(self, name: str, saved: SavedAdapter | None, *, strict: bool = True) -> None:
        """Under the lock, before a change is made: make it durable in the state file (when
        configured). Raises StateNotSaved (nothing changed) when it cannot be; not `strict`
        (undoing a change), a failure is logged instead."""
        if self._journal is not None:
            await asyncio.to_thread(self._journal.set, name, saved, strict=strict)

    async def _resave(self, name: str) -> None:
        """Under the lock: the state file's entry for `name` as the registry has it now."""
        record = self._records.get(name)
        await self._save(name, None if record is None else _saved(record), strict=False)

    async def _changed(self) -> None:
        if self.on_change is not None:
            await self.on_change()

    def _check_enabled(self) -> None:
        if not self.limits.enabled:
            raise LoraDisabled("LoRA is not enabled.")

    def _check_pin_capacity(self) -> None:
        pinned = sum(1 for r in self._records.values() if r.pin)
        if pinned + 1 > self.limits.max_pins:
            raise AdapterCapacity(
                f"No free lora slots: {pinned} adapters are pinned and at most "
                f"{self.limits.max_pins} may be (max_loras {self.limits.max_loras}, "
                f"max_cpu_loras {self.limits.max_cpu_loras}, one place stays unpinned)"
            )

    def _new_record(
        self,
        name: str,
        src: object,
        files: AdapterFiles,
        *,
        preload: bool,
        pin: bool,
        options: Mapping[str, str] | None,
    ) -> AdapterRecord:
        handle = AdapterHandle(name=name, int_id=self._id_for(files.digest), path=str(files.path))
        return AdapterRecord(
            name=name, src=str(src), handle=handle, rank=files.rank, preload=preload, pin=pin,
            options=dict(options or {}), digest=files.digest, fingerprint=files.fingerprint,
        )

    def _updated(
        self,
        old: AdapterRecord,
        src: object,
        files: AdapterFiles | None,
        *,
        preload: bool,
        pin: bool,
        options: dict[str, str],
    ) -> AdapterRecord:
        """Under the lock: the record after an update (a new one if the source moved or its
        files changed: the engine identity follows the contents)."""
        if files is not None:
            if str(files.path) != old.handle.path or files.digest != old.digest:
                record = self._new_record(
                    old.name, src, files, preload=preload, pin=pin, options=options
                )
                record.alias, record.origin = old.alias, old.origin
                self._records[old.name] = record
                self._retire(old)
                return record
            old.src = str(src)
        old.preload, old.pin, old.options = preload, pin, options
        return old

    def _id_for(self, digest: str) -> int:
        """Stable per content: the same files keep one id (and share one engine place);
        other files under a known name get a new one, so old weights are never served."""
        if digest not in self._ids:
            self._ids[digest] = self._next_id
            self._next_id += 1
        return self._ids[digest]

    async def _inspect(self, src: object) -> AdapterFiles:
        if isinstance(src, str) and self._fetcher is not None and self._fetcher.is_remote(src):
            self._fetcher.keep({Path(r.handle.path) for r in self._all_records()
                                if r.resident or r.pin})
            src = str(await self._fetcher.fetch(src))
        return await asyncio.to_thread(inspect_adapter, src, self.rules)

    def _source_of(self, record: AdapterRecord) -> str:
        """Where to read a record's files again: its remote source (the cached copy may have
        been evicted), else its folder."""
        remote = self._fetcher is not None and self._fetcher.is_remote(record.src)
        return record.src if remote else record.handle.path

    def _check_free(self, name: str) -> None:
        if name in self._records or name in self._aliases:
            raise AdapterExists(
                f"The adapter {name} already exists. If you want to replace it, please "
                "unregistering before registering a new adapter with the same name."
            )

    def _all_records(self) -> list[AdapterRecord]:
        return [*self._records.values(), *self._retired]

    def _find(self, handle: AdapterHandle) -> AdapterRecord | None:
        record = self._records.get(handle.name)
        if record is not None and record.handle is handle:
            return record
        return next((r for r in self._retired if r.handle is handle), None)

    def _signal_room(self) -> None:
        self._room.set()
        self._room = asyncio.Event()

    def _spawn(self, job: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _saved(record: AdapterRecord) -> SavedAdapter | None:
    """What the state file keeps of a record: management-API registrations only."""
    if record.origin != "api":
        return None
    return SavedAdapter(record.name, record.src, record.pin, record.preload, dict(record.options))


def _folder_gone(record: AdapterRecord) -> bool:
    return not Path(record.handle.path).is_dir()


def _check_pin_options(*, preload: bool, pin: bool) -> None:
    if pin and not preload:
        raise AdapterInvalid("Can not set preload to false and pin to true", param="pin")
