"""The registry's changes: register, update, unregister, aliases and reloads of changed files.

A change is written to the state file (`adapter_state`) before it becomes visible, so one that
cannot be made durable is refused having changed nothing; once made, everyone who shows adapters
(the other worker processes) is told before the change is answered (`notify`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping

from server.core.adapter_catalog import AdapterCatalog
from server.core.adapter_files import AdapterFiles, AdapterRules, check_name
from server.core.adapter_records import MERGED_NAME, MERGED_ORIGIN, AdapterLimits, AdapterRecord
from server.core.adapter_residency import AdapterResidency
from server.core.adapter_sources import AdapterSources
from server.core.adapter_state import AdapterJournal, SavedAdapter
from server.core.errors import (
    AdapterCapacity,
    AdapterExists,
    AdapterInvalid,
    GatewayError,
    InvalidRequest,
    LoraDisabled,
    Overloaded,
)

logger = logging.getLogger("gateway.adapters")


class AdapterChanges:
    def __init__(  # noqa: PLR0913 - the parts a change touches
        self, *, catalog: AdapterCatalog, residency: AdapterResidency, sources: AdapterSources,
        rules: AdapterRules, limits: AdapterLimits, journal: AdapterJournal | None,
        notify: Callable[[], Awaitable[None]],
    ) -> None:
        self._catalog = catalog
        self._residency = residency
        self._sources = sources
        self.rules = rules
        self.limits = limits
        # where management-API registrations are kept; read before the engine started, so a
        # damaged file has stopped the start already (server.gateway.saved_adapters)
        self.journal = journal
        self.notify = notify

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
        load: bool = False,
    ) -> AdapterRecord:
        """Validate and add an adapter; load it now if `preload` or `pin` (the errors:
        `AdapterRegistry.register`), or `load` (for the request that named it: a remote
        adapter's fetched folder stays held until then)."""
        check_enabled(self.limits)
        checked = check_name(name, self.rules)
        if origin != MERGED_ORIGIN and MERGED_NAME.fullmatch(checked):
            raise InvalidRequest(
                f"The adapter name {checked} is reserved for adapters composed by "
                "merged_adapters.", param="name",
            )
        _check_pin_options(preload=preload, pin=pin)
        self._catalog.check_free(checked)
        async with self._sources.fetched(src) as files:  # held until loaded
            async with self._catalog.lock:
                self._catalog.check_free(checked)
                if pin:
                    self._check_pin_capacity()
                record = self._catalog.new_record(checked, src, files, preload=preload, pin=pin,
                                                  options=options)
                record.alias, record.origin = alias, origin
                # durable before anyone sees it (only management registrations are kept)
                await self._save(checked, _saved(record), strict=origin == "api")
                self._catalog.by_name[checked] = record
                self._catalog.failed.pop(checked, None)
            try:
                if preload or pin:
                    await self._load_new(record)
                elif load:
                    await self._residency.wait_resident(checked, requested=checked, cold=True)
            finally:
                await self.notify()
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
        check_enabled(self.limits)
        self._catalog.get(name)
        async with contextlib.AsyncExitStack() as held:  # a new remote source: until loaded
            files = None if src is None else await held.enter_async_context(
                self._sources.fetched(src)
            )
            async with self._catalog.lock:
                old = self._catalog.get(name)
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
                await self.notify()
            return record

    async def unregister(self, name: str) -> AdapterRecord:
        """Forget the name now and remove the adapter from the engine; if requests are still
        running on it, they finish first and the engine copy goes when the last one ends."""
        async with self._catalog.lock:
            record = self._catalog.get(name)
            await self._save(name, None, strict=record.origin == "api")
            del self._catalog.by_name[name]
            record.removed = True
            self._catalog.retired.append(record)
        await self.notify()
        if record.inflight == 0:
            await self._residency.unload_settled(record)
        return record

    async def resave(self, name: str) -> None:
        """Make the state file's entry for `name` what the registry has now (at start, a saved
        registration that could not be registered again leaves the file as it left the lists)."""
        async with self._catalog.lock:
            await self._resave(name)

    async def add_alias(self, alias: str, target: str) -> None:
        """Let `alias` (a DJL workflow name) select adapter `target` in every protocol."""
        checked = check_name(alias, self.rules)
        if checked in self._catalog.by_name or checked in self._catalog.alias_of:
            raise AdapterExists(f"The name {checked} is already used by an adapter or workflow")
        self._catalog.get(target)
        self._catalog.alias_of[checked] = target
        await self.notify()

    async def reload_changed(self, name: str) -> AdapterRecord:
        """Re-read an adapter whose files changed on disk: same contents, same record; other
        contents, a new record with a new engine identity (the old one finishes its requests
        and leaves). Raises AdapterInvalid if the files are no longer a valid adapter."""
        old = self._catalog.get(name)
        # fetched before the lock (a remote source's network I/O), the state checked again after
        async with self._sources.fetched(self._sources.source_of(old)) as files:
            async with self._catalog.lock:
                current = self._catalog.get(name)
                if current is not old:
                    return current  # changed meanwhile: the newer record is current
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
                await self.notify()
        return record

    # ---- loading a change, undoing a failed one --------------------------------------------
    async def _load_new(
        self, record: AdapterRecord, *, previous: AdapterRecord | None = None,
        was_pinned: bool = False,
    ) -> None:
        """Load a just registered or updated adapter; undo the change if that fails."""
        try:
            await self._residency.wait_resident(record.name, requested=record.name)
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
        async with self._catalog.lock:
            if previous is record:
                record.pin = was_pinned
            elif self._catalog.by_name.get(record.name) is not record:
                return  # changed again meanwhile: leave the newer state alone
            else:
                del self._catalog.by_name[record.name]
                if previous is not None:  # an update that moved the source: restore the old one
                    previous.removed = False
                    self._catalog.retired = [r for r in self._catalog.retired if r is not previous]
                    self._catalog.by_name[record.name] = previous
                self._residency.retire(record)
            await self._resave(record.name)

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
                record = self._catalog.new_record(
                    old.name, src, files, preload=preload, pin=pin, options=options
                )
                record.alias, record.origin = old.alias, old.origin
                self._catalog.by_name[old.name] = record
                self._residency.retire(old)
                return record
            old.src = str(src)
        old.preload, old.pin, old.options = preload, pin, options
        return old

    # ---- the state file --------------------------------------------------------------------
    async def _save(self, name: str, saved: SavedAdapter | None, *, strict: bool = True) -> None:
        """Under the lock, before a change is made: make it durable in the state file (when
        configured). Raises StateNotSaved (nothing changed) when it cannot be; not `strict`
        (undoing a change), a failure is logged instead."""
        if self.journal is not None:
            await asyncio.to_thread(self.journal.set, name, saved, strict=strict)

    async def _resave(self, name: str) -> None:
        """Under the lock: the state file's entry for `name` as the registry has it now."""
        record = self._catalog.by_name.get(name)
        await self._save(name, None if record is None else _saved(record), strict=False)

    def _check_pin_capacity(self) -> None:
        pinned = sum(1 for r in self._catalog.by_name.values() if r.pin)
        if pinned + 1 > self.limits.max_pins:
            raise AdapterCapacity(
                f"No free lora slots: {pinned} adapters are pinned and at most "
                f"{self.limits.max_pins} may be (max_loras {self.limits.max_loras}, "
                f"max_cpu_loras {self.limits.max_cpu_loras}, one place stays unpinned)"
            )


def check_enabled(limits: AdapterLimits) -> None:
    if not limits.enabled:
        raise LoraDisabled("LoRA is not enabled.")


def _saved(record: AdapterRecord) -> SavedAdapter | None:
    """What the state file keeps of a record: management-API registrations only."""
    if record.origin != "api":
        return None
    return SavedAdapter(record.name, record.src, record.pin, record.preload, dict(record.options))


def _check_pin_options(*, preload: bool, pin: bool) -> None:
    if pin and not preload:
        raise AdapterInvalid("Can not set preload to false and pin to true", param="pin")
