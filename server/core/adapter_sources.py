"""Where adapter files come from: the adapter source port.

An `AdapterSource` turns a source string, as an operator or a request gave it, into a complete
local folder. `LocalFolders` serves plain paths (checked by `adapter_files.resolve_source` against
the allowed roots); an `AdapterFetcher` (server/sources: `s3://`, `https://`, `hf://` …) brings a
remote location into a local, validated, content-addressed cache folder. `AdapterSources` is what
the registry holds: the remote stores first, local folders for everything else; whatever the
source, the folder it gives is validated and digested by `adapter_files.inspect_adapter` before
the registry or the engine uses it.

A remote adapter's cached folder may be evicted whenever no one uses it: `fetched` and `current`
hold it until their block ends (a registration, a load), and the folders of adapters loaded or
pinned are kept. Fetches (network I/O) run outside the registry's lock: callers take the lock
inside the block, after the files are there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol

from server.core.adapter_files import (
    AdapterFiles,
    AdapterRules,
    fingerprint,
    inspect_adapter,
    resolve_source,
)
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
        """A complete local folder holding the adapter at `src` (a fetcher's: held until
        `release`). Raises InvalidRequest (no
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

    def hold(self, folder: Path) -> bool:
        """Hold a cache folder (never evicted until `release`) if it is still there."""
        ...

    def release(self, folder: Path) -> None:
        """One hold less on a folder `resolve` or `hold` gave."""
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

    @contextlib.asynccontextmanager
    async def fetched(self, src: object) -> AsyncIterator[AdapterFiles]:
        """The validated, digested files of the adapter at `src`, wherever it is; a remote
        adapter's cached folder is held until the block ends."""
        remote = self._remote
        if remote is None or not remote.serves(src):
            folder = await self._local.resolve(src)
            yield await asyncio.to_thread(inspect_adapter, str(folder), self._rules)
            return
        remote.keep(self._in_use())
        folder = await remote.resolve(src)
        try:
            yield await asyncio.to_thread(inspect_adapter, str(folder), self._rules)
        finally:
            self._let_go(remote, folder)

    @contextlib.asynccontextmanager
    async def current(self, record: AdapterRecord) -> AsyncIterator[AdapterFiles | None]:
        """Before a load: a remote record's cached folder, held until the block ends. None when
        its own folder is still there and unchanged; else fetched again (its cached copy was
        evicted), the files fetched. A local record: None, nothing held (its changes are looked
        for under the lock)."""
        remote = self._remote
        if remote is None or not remote.serves(record.src):
            yield None
            return
        folder = Path(record.handle.path)
        if remote.hold(folder):
            if fingerprint(folder) == record.fingerprint:
                try:
                    yield None
                finally:
                    self._let_go(remote, folder)
                return
            remote.release(folder)
        async with self.fetched(record.src) as files:
            yield files

    def _let_go(self, remote: AdapterFetcher, folder: Path) -> None:
        """The end of a block that held `folder`: what it loaded is kept before the hold goes."""
        remote.keep(self._in_use())
        remote.release(folder)

    def source_of(self, record: AdapterRecord) -> str:
        """Where to read a record's files again: its remote source (the cached copy may have
        been evicted), else its folder."""
        return record.src if self.is_remote(record.src) else record.handle.path
