"""Where adapter files come from: the adapter source port.

An `AdapterSource` turns a source string, as an operator or a request gave it, into a complete
local folder. `LocalFolders` serves plain paths (checked by `adapter_files.resolve_source` against
the allowed roots); an `AdapterFetcher` (server/sources: `s3://`, `https://`, `hf://` …) brings a
remote location into a local, validated, content-addressed cache folder. `AdapterSources` is what
the registry holds: the remote stores first, local folders for everything else; whatever the
source, the folder it gives is validated and digested by `adapter_files.inspect_adapter` before
the registry or the engine uses it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from server.core.adapter_files import AdapterFiles, AdapterRules, inspect_adapter, resolve_source
from server.core.adapter_records import AdapterRecord
from server.core.errors import AdapterInvalid


class AdapterSourceFailed(AdapterInvalid):
    """A remote source could not deliver the adapter in time: unreachable, refused credentials,
    a transfer that broke, or a deadline that passed (retries included)."""

    error_type = "adapter_source_failed"


class AdapterSource(Protocol):
    """Brings the adapter a source string names to a local folder."""

    def serves(self, src: object) -> bool:
        """Whether `src` names a location this source serves."""
        ...

    async def resolve(self, src: object) -> Path:
        """A complete local folder holding the adapter at `src`. Raises InvalidRequest (no
        source given), AdapterSourceMissing (nothing there), AdapterInvalid (a location that is
        not allowed, corrupt or unsafe contents) or AdapterSourceFailed (a remote store that did
        not deliver within its time bound)."""
        ...


class AdapterFetcher(AdapterSource, Protocol):
    """A remote store's source: fetched once however many callers wait, into a cache."""

    @property
    def prefixes(self) -> tuple[str, ...]:
        """Where a request's unknown adapter name is looked up (`<prefix><name>`), in order."""
        ...

    def keep(self, folders: set[Path]) -> None:
        """The cache folders the registry needs now (loaded or pinned): never evicted."""
        ...


class LocalFolders:
    """Plain paths: a directory inside the allowed roots, symlinks resolved."""

    def __init__(self, rules: AdapterRules) -> None:
        self._rules = rules

    def serves(self, src: object) -> bool:
        return True

    async def resolve(self, src: object) -> Path:
        return await asyncio.to_thread(resolve_source, src, self._rules)


class AdapterSources:
    """The registry's sources: the remote stores when configured, local folders otherwise."""

    def __init__(
        self, rules: AdapterRules, remote: AdapterFetcher | None,
        in_use: Callable[[], set[Path]],
    ) -> None:
        self._rules = rules
        self._local = LocalFolders(rules)
        self._remote = remote
        self._in_use = in_use  # the folders of loaded or pinned adapters (kept in the cache)

    @property
    def prefixes(self) -> tuple[str, ...]:
        """Where a request's unknown adapter name is looked up; () without remote stores."""
        return () if self._remote is None else self._remote.prefixes

    def is_remote(self, src: object) -> bool:
        return self._remote is not None and self._remote.serves(src)

    async def inspect(self, src: object) -> AdapterFiles:
        """The validated, digested files of the adapter at `src`, wherever it is."""
        source: AdapterSource = self._local
        if self._remote is not None and self._remote.serves(src):
            self._remote.keep(self._in_use())
            source = self._remote
        folder = await source.resolve(src)
        return await asyncio.to_thread(inspect_adapter, str(folder), self._rules)

    def source_of(self, record: AdapterRecord) -> str:
        """Where to read a record's files again: its remote source (the cached copy may have
        been evicted), else its folder."""
        return record.src if self.is_remote(record.src) else record.handle.path
