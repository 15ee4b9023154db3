"""Where adapter files come from: the adapter source port.

A source string is either a local folder (checked by `adapter_files.resolve_source` against the
allowed roots) or a remote location with a scheme (`s3://`, `https://`, `hf://` …). A remote one
is brought into a local, validated, content-addressed cache folder by an `AdapterFetcher` before
the registry inspects it, so the registry and the engine only ever see complete local folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from server.core.errors import AdapterInvalid


class AdapterSourceFailed(AdapterInvalid):
    """A remote source could not deliver the adapter in time: unreachable, refused credentials,
    a transfer that broke, or a deadline that passed (retries included)."""

    error_type = "adapter_source_failed"


class AdapterFetcher(Protocol):
    """Brings remote adapter sources to local folders."""

    @property
    def prefixes(self) -> tuple[str, ...]:
        """Where a request's unknown adapter name is looked up (`<prefix><name>`), in order."""
        ...

    def is_remote(self, src: str) -> bool:
        """Whether `src` names a location this fetcher serves (rather than a local path)."""
        ...

    async def fetch(self, src: str) -> Path:
        """A complete local folder holding the adapter at `src`, fetched once however many
        callers wait. Raises AdapterSourceMissing (nothing there), AdapterInvalid (corrupt, unsafe
        or oversized contents, a digest mismatch) or AdapterSourceFailed, within the fetcher's
        time bound."""
        ...

    def keep(self, folders: set[Path]) -> None:
        """The cache folders the registry needs now (loaded or pinned): never evicted."""
        ...
