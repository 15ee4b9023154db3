"""The request path: an adapter acquired for a request (loaded first if need be) and counted
as in use until it is released, when its place may go to another adapter."""

from __future__ import annotations

from pathlib import Path

from server.core.adapter_catalog import AdapterCatalog
from server.core.adapter_changes import AdapterChanges
from server.core.adapter_discovery import AdapterDiscovery
from server.core.adapter_files import fingerprint
from server.core.adapter_residency import AdapterResidency
from server.core.errors import AdapterNotFound
from server.core.types import AdapterHandle


class AdapterLeases:
    def __init__(
        self, *, catalog: AdapterCatalog, residency: AdapterResidency, changes: AdapterChanges,
        discovery: AdapterDiscovery,
    ) -> None:
        self._catalog = catalog
        self._residency = residency
        self._changes = changes
        self._discovery = discovery

    async def acquire(self, name: str) -> AdapterHandle:
        """The handle of a loaded adapter, counted as in use until `release`.

        Loads the adapter first if it is not in the engine (waiting for a free cached place if
        all are pinned or busy). Raises AdapterNotFound, AdapterInvalid, Overloaded.
        """
        target = self._catalog.alias_of.get(name, name)
        record = self._catalog.by_name.get(target)
        if record is None:
            await self._discovery.discover(target, requested=name, load=True)
            record = self._catalog.by_name.get(target)
            if record is None:
                raise AdapterNotFound(f"The model `{name}` does not exist.")
        if record.resident and fingerprint(Path(record.handle.path)) != record.fingerprint:
            record = await self._changes.reload_changed(record.name)  # never serve replaced weights
        if not record.resident:
            record = await self._residency.wait_resident(target, requested=name, cold=True)
        record.inflight += 1
        record.requests += 1
        record.prefetched = False
        self._residency.mark_used(record)
        return record.handle

    def release(self, handle: AdapterHandle, generated_tokens: int = 0) -> None:
        record = self._catalog.find(handle)
        if record is None:
            return
        record.inflight = max(0, record.inflight - 1)
        record.generated_tokens += generated_tokens
        self._residency.mark_used(record)
        if record.inflight == 0:
            self._residency.signal_room()
            if record.removed:
                self._residency.spawn(self._residency.unload_settled(record))
