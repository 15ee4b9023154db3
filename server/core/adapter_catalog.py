"""The registry's catalog: adapter names, their records, aliases (DJL workflows), the folder
refusals, the records retired but still in the engine, and the engine ids given per content.

Plain state and look-ups: changes go through `adapter_changes` under `lock`."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from server.core.adapter_files import AdapterFiles
from server.core.adapter_records import (
    MERGED_ORIGIN,
    AdapterRecord,
    AdapterSnapshot,
    Failure,
    RegistryView,
)
from server.core.errors import AdapterExists, AdapterNotFound
from server.core.types import AdapterHandle


class AdapterCatalog:
    def __init__(self) -> None:
        self.by_name: dict[str, AdapterRecord] = {}
        self.alias_of: dict[str, str] = {}  # alias (DJL workflow name) -> adapter name
        self.retired: list[AdapterRecord] = []  # unregistered or replaced, still in use/loaded
        self.failed: dict[str, Failure] = {}  # folder adapters refused, until their files change
        self._ids: dict[str, int] = {}  # content digest -> engine id (same files, same slot)
        self._next_id = 1
        self.lock = asyncio.Lock()  # serialises changes of the registry and of the engine

    # ---- queries ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Registered adapter names, in registration order (composed ones are not listed)."""
        return [r.name for r in self.records()]

    def records(self) -> list[AdapterRecord]:
        return [r for r in self.by_name.values() if r.origin != MERGED_ORIGIN]

    def merged_records(self) -> list[AdapterRecord]:
        """The composed adapters registered now (server/core/composition.py)."""
        return [r for r in self.by_name.values() if r.origin == MERGED_ORIGIN]

    def is_merged(self, name: str) -> bool:
        """Whether `name` is a composed adapter registered now."""
        record = self.by_name.get(name)
        return record is not None and record.origin == MERGED_ORIGIN

    def paths_in_use(self) -> set[str]:
        """The folders of every adapter registered, or unregistered but still in the engine."""
        return {r.handle.path for r in self.all_records()}

    def get(self, name: str) -> AdapterRecord:
        record = self.by_name.get(name)
        if record is None:
            raise AdapterNotFound(f"The adapter {name} was not found", param="name")
        return record

    def resolve(self, name: str) -> AdapterRecord:
        """The record for an adapter name or an alias of one. Raises AdapterNotFound."""
        return self.get(self.alias_of.get(name, name))

    def listed(self, name: str) -> bool | None:
        """Whether a request may name `name` (registered or an alias, not composed); None when
        the catalog does not know it."""
        record = self.by_name.get(self.alias_of.get(name, name))
        return None if record is None else record.origin != MERGED_ORIGIN

    def canonical(self, name: str) -> str:
        """The adapter name an alias stands for; any other name as given (even unknown)."""
        return self.alias_of.get(name, name)

    def aliases(self) -> dict[str, str]:
        return dict(self.alias_of)

    def failures(self) -> dict[str, Failure]:
        """Folder adapters that were refused, with the reason (shown by describe)."""
        return dict(self.failed)

    def snapshots(self) -> list[AdapterSnapshot]:
        return [record.snapshot() for record in self.by_name.values()]

    def view(self) -> RegistryView:
        """What other workers need to route and list adapters as this registry does."""
        return RegistryView(
            records=tuple(self.by_name.values()), aliases=dict(self.alias_of),
            failed=dict(self.failed),
        )

    def show(self, view: RegistryView) -> None:
        """Take another registry's view as this one's names, aliases and refusals."""
        self.by_name = {record.name: record for record in view.records}
        self.alias_of = dict(view.aliases)
        self.failed = dict(view.failed)

    def all_records(self) -> list[AdapterRecord]:
        return [*self.by_name.values(), *self.retired]

    def find(self, handle: AdapterHandle) -> AdapterRecord | None:
        record = self.by_name.get(handle.name)
        if record is not None and record.handle is handle:
            return record
        return next((r for r in self.retired if r.handle is handle), None)

    # ---- checks and new records --------------------------------------------------------------
    def check_free(self, name: str) -> None:
        if name in self.by_name or name in self.alias_of:
            raise AdapterExists(
                f"The adapter {name} already exists. If you want to replace it, please "
                "unregistering before registering a new adapter with the same name."
            )

    def new_record(
        self,
        name: str,
        src: object,
        files: AdapterFiles,
        *,
        preload: bool,
        pin: bool,
        options: Mapping[str, str] | None,
    ) -> AdapterRecord:
        handle = AdapterHandle(name=name, int_id=self.id_for(files.digest), path=str(files.path))
        return AdapterRecord(
            name=name, src=str(src), handle=handle, rank=files.rank, preload=preload, pin=pin,
            options=dict(options or {}), digest=files.digest, fingerprint=files.fingerprint,
        )

    def id_for(self, digest: str) -> int:
        """Stable per content: the same files keep one id (and share one engine place);
        other files under a known name get a new one, so old weights are never served."""
        if digest not in self._ids:
            self._ids[digest] = self._next_id
            self._next_id += 1
        return self._ids[digest]
