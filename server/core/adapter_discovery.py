"""Adapters found rather than registered: the folders of the discovery dirs (adapterDir, the
model folder's adapters/) and the remote `adapterSources` prefixes, registered on their first
request, and the folders kept in sync by a periodic rescan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from server.core.adapter_catalog import AdapterCatalog
from server.core.adapter_changes import AdapterChanges
from server.core.adapter_files import NAME_PATTERN, AdapterRules, fingerprint
from server.core.adapter_records import AdapterLimits, AdapterRecord, Failure, SyncReport
from server.core.adapter_sources import AdapterSources
from server.core.errors import (
    AdapterExists,
    AdapterInvalid,
    AdapterNotFound,
    AdapterSourceMissing,
    GatewayError,
)

logger = logging.getLogger("gateway.adapters")


class AdapterDiscovery:
    def __init__(
        self, *, catalog: AdapterCatalog, changes: AdapterChanges, sources: AdapterSources,
        rules: AdapterRules, limits: AdapterLimits, notify: Callable[[], Awaitable[None]],
    ) -> None:
        self._catalog = catalog
        self._changes = changes
        self._sources = sources
        self.rules = rules
        self.limits = limits
        self._notify = notify
        self._discovering: dict[str, asyncio.Future[None]] = {}  # first requests load once

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

    def may_fetch(self, name: str) -> bool:
        """Whether a request's unknown `name` is looked up in `adapterSources` (on first use)."""
        return (
            bool(self._sources.prefixes) and self.limits.on_demand
            and bool(NAME_PATTERN.match(name)) and name not in self.rules.base_names
        )

    async def discover(self, name: str, *, requested: str, load: bool = False) -> None:
        """Register the folder `name` of a discovery dir on its first request; concurrent first
        requests share one registration. A refused folder stays refused (AdapterInvalid with
        its reason) until its files change. Raises AdapterNotFound when there is no folder.
        `load`: a remote adapter is loaded too, before its fetched folder may be evicted."""
        path = self.found(name)
        if path is None and not self.may_fetch(name):
            raise AdapterNotFound(f"The model `{requested}` does not exist.")
        if path is not None and (failure := self._still_refused(name, path)) is not None:
            raise AdapterInvalid(failure.reason, param="model")
        pending = self._discovering.get(name)
        if pending is None:
            found = (
                self._register_found(name, path) if path else self._register_remote(name, load)
            )
            pending = asyncio.ensure_future(found)
            self._discovering[name] = pending
            pending.add_done_callback(lambda _: self._discovering.pop(name, None))
        await asyncio.shield(pending)

    def _still_refused(self, name: str, path: Path) -> Failure | None:
        """The refusal of this folder, unless its files changed since (then it is retried)."""
        failure = self._catalog.failed.get(name)
        if failure is None or failure.fingerprint != fingerprint(path):
            return None
        return failure

    async def _register_found(self, name: str, path: Path) -> None:
        try:
            await self._changes.register(name, str(path), preload=False, origin="folder")
        except AdapterExists:
            return  # registered meanwhile (a management call or a folder scan)
        except GatewayError as exc:
            self._catalog.failed[name] = Failure(str(path), exc.message, fingerprint(path))
            logger.error("adapter folder %s refused: %s", path, exc.message)
            await self._notify()
            raise
        logger.info("adapter %s registered from its folder %s", name, path)

    async def _register_remote(self, name: str, load: bool) -> None:
        """Register `name` from the first `adapterSources` prefix that has it (and load it)."""
        for prefix in self._sources.prefixes:
            src = prefix.replace("{name}", name) if "{name}" in prefix else prefix + name
            try:
                await self._changes.register(
                    name, src, preload=False, origin="source", load=load
                )
            except AdapterSourceMissing:
                continue
            except AdapterExists:
                return  # registered meanwhile
            logger.info("adapter %s registered from %s", name, src)
            return
        raise AdapterNotFound(f"The model `{name}` does not exist.")

    async def sync_folders(self) -> SyncReport:
        """One rescan of the discovery dirs: new folders registered (served on first request),
        folders gone unregistered (their running requests finish), changed files reloaded."""
        present = self._folders()
        added: list[str] = []
        failed: list[str] = []
        for name, path in present.items():
            if name in self._catalog.by_name or name in self._catalog.alias_of:
                continue
            if self._still_refused(name, path) is not None:
                continue
            try:
                await self._register_found(name, path)
                added.append(name)
            except GatewayError:
                failed.append(name)
        gone = [n for n in self._catalog.failed if n not in present]
        for name in gone:
            del self._catalog.failed[name]
        if gone:
            await self._notify()
        removed, reloaded = await self._sync_registered()
        return SyncReport(tuple(added), tuple(removed), tuple(reloaded), tuple(failed))

    async def _sync_registered(self) -> tuple[list[str], list[str]]:
        """Registered folder adapters whose folder is gone (unregistered) or whose files
        changed (reloaded). Remote adapters are not looked at: their cached copy, evicted or
        not, is no change (an evicted one is fetched again by its next load)."""
        removed, reloaded = [], []
        for record in list(self._catalog.by_name.values()):
            if self._sources.is_remote(record.src):
                continue
            # the record's own folder, looked at now: one registered by a request during this
            # scan is not in `present`, yet its folder is there
            if record.origin == "folder" and _folder_gone(record):
                with contextlib.suppress(AdapterNotFound):  # unregistered meanwhile
                    await self._changes.unregister(record.name)
                    removed.append(record.name)
            elif fingerprint(Path(record.handle.path)) != record.fingerprint and (
                await self._reloaded(record.name)
            ):
                reloaded.append(record.name)
        return removed, reloaded

    async def _reloaded(self, name: str) -> bool:
        try:
            before = self._catalog.get(name)
            return await self._changes.reload_changed(name) is not before
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


def _folder_gone(record: AdapterRecord) -> bool:
    return not Path(record.handle.path).is_dir()
