"""The one adapter registry behind every protocol and every management route.

It owns the adapters' names, sources, stable integer ids, options, pins, aliases (DJL workflows)
and their residency in the engine, and it is the only code that adds adapters to or removes them
from the engine. `AdapterRegistry` is the façade over its parts, each a module of its own:

- `adapter_catalog`: names, records, aliases, refusals, engine ids (state and look-ups);
- `adapter_sources`: where adapter files come from (local folders, remote stores: the port);
- `adapter_changes`: register, update, unregister, aliases, reloads, made durable first in the
  state file (`adapter_state`) and told to the other workers before they are answered;
- `adapter_residency`: what the engine holds (loading, LRU eviction, pins, settling);
- `adapter_leases`: the request path's acquire and release (in-flight counts);
- `adapter_discovery`: adapter folders and remote prefixes served on first use, folder rescans;
- `adapter_commands`: the command set every change goes through (`run`), here (the owner) or, on
  another worker, in the owner's process (`RegistryOwnerPort`, server/runtime/worker_link.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar, assert_never, cast

from server.core.adapter_catalog import AdapterCatalog
from server.core.adapter_changes import AdapterChanges, check_enabled
from server.core.adapter_commands import (
    Acquire,
    AdapterCommand,
    AddAlias,
    Command,
    Compose,
    EngineResident,
    Ensure,
    Prefetch,
    Refresh,
    Register,
    RegistryOwnerPort,
    ReloadChanged,
    Resave,
    SyncFolders,
    Unregister,
    Update,
)
from server.core.adapter_discovery import AdapterDiscovery
from server.core.adapter_files import AdapterRules
from server.core.adapter_leases import AdapterLeases
from server.core.adapter_records import (
    LOAD_BUCKETS,
    AdapterLimits,
    AdapterRecord,
    AdapterSnapshot,
    Failure,
    RegistryView,
    Residency,
    SyncReport,
)
from server.core.adapter_residency import AdapterResidency
from server.core.adapter_sources import AdapterFetcher, AdapterSources
from server.core.adapter_state import AdapterJournal
from server.core.composition import Composition
from server.core.engine import Engine
from server.core.errors import AdapterNotFound, LoraDisabled
from server.core.types import AdapterHandle, AdapterMerge

logger = logging.getLogger("gateway.adapters")
T = TypeVar("T")


class AdapterRegistry:
    def __init__(  # noqa: PLR0913 - its parts, all passed in when built
        self, *, engine: Engine, rules: AdapterRules, limits: AdapterLimits,
        state_file: Path | None = None,
        fetcher: AdapterFetcher | None = None,
        owner: RegistryOwnerPort | None = None,
        composition: Composition | None = None,
        on_change: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.rules = rules
        self.limits = limits
        # None: this registry owns the adapters; else the owner its commands go to (a mirror
        # reads the owner's pushed view, and the fetcher only tells which names sources hold)
        self._owner = owner
        # read before the engine started, so a damaged file has stopped the start already
        journal = None if state_file is None or owner is not None else AdapterJournal(state_file)
        if journal is not None:
            journal.load()
        self._catalog = AdapterCatalog()
        self._sources = AdapterSources(rules, fetcher, self._kept_folders)
        self._residency = AdapterResidency(
            catalog=self._catalog, engine=engine, limits=limits, sources=self._sources
        )
        self._changes = AdapterChanges(
            catalog=self._catalog, residency=self._residency, sources=self._sources,
            rules=rules, limits=limits, journal=journal, notify=self._changed,
        )
        self._discovery = AdapterDiscovery(
            catalog=self._catalog, changes=self._changes, sources=self._sources, rules=rules,
            limits=limits, notify=self._changed,
        )
        self._leases = AdapterLeases(
            catalog=self._catalog, residency=self._residency, changes=self._changes,
            discovery=self._discovery,
        )
        # awaited after every change of names, sources, pins or refusals, before the change is
        # answered: how the other worker processes see it (server.runtime.worker_link.py)
        self.on_change = on_change
        self.composition = composition  # None: requests may not compose adapters

    # ---- queries ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Registered adapter names, in registration order (composed ones are not listed)."""
        return self._catalog.names()

    def records(self) -> list[AdapterRecord]:
        return self._catalog.records()

    def merged_records(self) -> list[AdapterRecord]:
        """The composed adapters registered now (server/core/composition.py)."""
        return self._catalog.merged_records()

    def is_merged(self, name: str) -> bool:
        """Whether `name` is a composed adapter registered now."""
        return self._catalog.is_merged(name)

    def paths_in_use(self) -> set[str]:
        """The folders of every adapter registered, or unregistered but still in the engine."""
        return self._catalog.paths_in_use()

    def get(self, name: str) -> AdapterRecord:
        return self._catalog.get(name)

    def resolve(self, name: str) -> AdapterRecord:
        """The record for an adapter name or an alias of one. Raises AdapterNotFound."""
        return self._catalog.resolve(name)

    def __contains__(self, name: object) -> bool:
        """Registered, an alias, or a folder under a discovery dir (served on first use)."""
        if not isinstance(name, str):
            return False
        listed = self._catalog.listed(name)
        if listed is not None:
            return listed
        return self.found(name) is not None or self._discovery.may_fetch(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.records())

    def found(self, name: str) -> Path | None:
        """The folder named `name` in the first discovery dir that has one, if any."""
        return self._discovery.found(name)

    def failures(self) -> dict[str, Failure]:
        """Folder adapters that were refused, with the reason (shown by describe)."""
        return self._catalog.failures()

    def is_resident(self, name: str) -> bool:
        """Whether the engine holds the adapter `name` (an alias, or any name) now, as far as
        this registry knows (another worker's: as of the owner's last view)."""
        record = self._catalog.by_name.get(self._catalog.canonical(name))
        return record is not None and record.resident

    def canonical(self, name: str) -> str:
        """The adapter name an alias stands for; any other name as given (even unknown)."""
        return self._catalog.canonical(name)

    def aliases(self) -> dict[str, str]:
        return self._catalog.aliases()

    def snapshots(self) -> list[AdapterSnapshot]:
        return self._catalog.snapshots()

    def view(self) -> RegistryView:
        """What other workers need to route and list adapters as this registry does."""
        return self._catalog.view()

    def show(self, view: RegistryView) -> None:
        """Take another registry's view as this one's names, aliases and refusals."""
        self._catalog.show(view)

    async def refresh(self) -> None:
        """Bring records' numbers and residency up to date before showing them (a mirror
        asks the owner; the owner's are always current)."""
        if self._owner is not None:
            self.show(await self._owner.run(Refresh()))

    # ---- commands: each runs where the adapters are owned ----------------------------------
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
        return await self.run(Register(
            name=name, src=src, preload=preload, pin=pin,
            options=None if options is None else dict(options), alias=alias, origin=origin,
        ))

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
        return await self.run(Update(
            name=name, src=src, preload=preload, pin=pin,
            options=None if options is None else dict(options),
        ))

    async def unregister(self, name: str) -> AdapterRecord:
        """Forget the name now and remove the adapter from the engine; if requests are still
        running on it, they finish first and the engine copy goes when the last one ends."""
        return await self.run(Unregister(name))

    async def resave(self, name: str) -> None:
        """Make the state file's entry for `name` what the registry has now (at start, a saved
        registration that could not be registered again leaves the file as it left the lists)."""
        await self.run(Resave(name))

    async def add_alias(self, alias: str, target: str) -> None:
        """Let `alias` (a DJL workflow name) select adapter `target` in every protocol."""
        await self.run(AddAlias(alias, target))

    async def reload_changed(self, name: str) -> AdapterRecord:
        """Re-read an adapter whose files changed on disk: same contents, same record; other
        contents, a new record with a new engine identity (the old one finishes its requests
        and leaves). Raises AdapterInvalid if the files are no longer a valid adapter."""
        return await self.run(ReloadChanged(name))

    async def sync_folders(self) -> SyncReport:
        """One rescan of the discovery dirs: new folders registered (served on first request),
        folders gone unregistered (their running requests finish), changed files reloaded."""
        return await self.run(SyncFolders())

    async def ensure(self, name: str) -> AdapterRecord:
        """The record of a registered adapter (or alias), registering an adapter folder on its
        first use. Composed adapters are not found. Raises AdapterNotFound."""
        return await self.run(Ensure(name))

    async def compose(self, merge: AdapterMerge) -> str:
        """The registered name of the adapter `merge` composes (composed and registered first
        when new). Raises LoraDisabled, AdapterNotFound, AdapterInvalid, InvalidRequest."""
        return await self.run(Compose(merge))

    async def acquire(self, name: str) -> AdapterHandle:
        """The handle of a loaded adapter, counted as in use until `release`.

        Loads the adapter first if it is not in the engine (waiting for a free cached place if
        all are pinned or busy). Raises AdapterNotFound, AdapterInvalid, Overloaded.
        """
        return await self.run(Acquire(name))

    async def prefetch(self, name: str) -> bool:
        """Load a registered adapter into the engine ahead of its requests, if a cached place is
        free or held by an idle adapter (never one loaded ahead itself); never waits. Returns
        whether it is in the engine now (False: no room yet). Raises AdapterNotFound,
        AdapterInvalid, GatewayError (the engine refused)."""
        return await self.run(Prefetch(name))

    async def engine_resident(self) -> set[str]:
        """Names of registered adapters the engine really holds now (asks the engine)."""
        return await self.run(EngineResident())

    def release(self, handle: AdapterHandle, generated_tokens: int = 0) -> None:
        if self._owner is not None:
            self._owner.release(handle, generated_tokens)
        else:
            self._leases.release(handle, generated_tokens)

    # ---- compositions of commands ----------------------------------------------------------
    async def acquire_merged(self, merge: AdapterMerge) -> AdapterHandle:
        """`acquire` of the adapter `merge` composes; composed again if it was unregistered
        (evicted by another composition) between the two steps."""
        try:
            return await self.acquire(await self.compose(merge))
        except AdapterNotFound:
            return await self.acquire(await self.compose(merge))

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

    # ---- the dispatch table ----------------------------------------------------------------
    async def run(self, command: Command[T]) -> T:
        """Run `command` where the adapters are owned: here, or in the owner's process."""
        if self._owner is not None:
            return await self._owner.run(command)
        return cast(T, await self.execute(cast(AdapterCommand, command)))

    async def execute(self, command: AdapterCommand) -> Any:  # noqa: C901, PLR0911, PLR0912 - one table
        """The owner's dispatch table: every command, run here."""
        match command:
            case Register():
                return await self._changes.register(
                    command.name, command.src, preload=command.preload, pin=command.pin,
                    options=command.options, alias=command.alias, origin=command.origin,
                )
            case Update():
                return await self._changes.update(
                    command.name, src=command.src, preload=command.preload, pin=command.pin,
                    options=command.options,
                )
            case Unregister():
                return await self._changes.unregister(command.name)
            case Resave():
                return await self._changes.resave(command.name)
            case AddAlias():
                return await self._changes.add_alias(command.alias, command.target)
            case ReloadChanged():
                return await self._changes.reload_changed(command.name)
            case SyncFolders():
                return await self._discovery.sync_folders()
            case Ensure():
                return await self._ensure(command.name)
            case Compose():
                return await self._compose(command.merge)
            case Acquire():
                return await self._leases.acquire(command.name)
            case Prefetch():
                return await self._residency.prefetch(command.name)
            case EngineResident():
                return await self._residency.engine_resident()
            case Refresh():
                return self.view()
            case _:
                assert_never(command)

    async def _ensure(self, name: str) -> AdapterRecord:
        if name not in self:
            raise AdapterNotFound(f"The adapter `{name}` does not exist.", param="merged_adapters")
        target = self.canonical(name)
        if target not in self._catalog.by_name:
            await self._discovery.discover(target, requested=name)
        return self.get(target)

    async def _compose(self, merge: AdapterMerge) -> str:
        check_enabled(self.limits)
        if self.composition is None:
            raise LoraDisabled("Merging adapters is not enabled on this server.")
        return await self.composition.compose(self, merge)

    async def _changed(self) -> None:
        if self.on_change is not None:
            await self.on_change()

    def _kept_folders(self) -> set[Path]:
        """The folders a remote source's cache must keep: loaded or pinned adapters'."""
        return {Path(r.handle.path) for r in self._catalog.all_records() if r.resident or r.pin}


__all__ = [
    "LOAD_BUCKETS", "AdapterLimits", "AdapterRecord", "AdapterRegistry", "AdapterSnapshot",
    "Failure", "RegistryView", "Residency", "SyncReport",
]
