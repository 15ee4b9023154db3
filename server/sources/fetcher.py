"""`RemoteSources`: the adapter source port for remote locations (s3, https archives, hf).

One fetch per location however many callers wait; each within one time bound (retries of
transient failures included) after which the caller gets `AdapterSourceFailed` and whatever the
abandoned attempt still does is never registered. Every download is checked exactly as a local
adapter folder (`check`) before the cache takes it. Each caller gets the folder held in the cache
(never evicted) until it calls `release`; a fetch holds it from its commit until every caller
waiting for it took its own hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from server.core.adapter_files import content_digest
from server.core.adapter_sources import AdapterSourceFailed
from server.core.errors import AdapterSourceMissing, GatewayError
from server.sources.archive import adapter_root
from server.sources.cache import AdapterCache
from server.sources.remote import Deadline, FetchObserver, NoObserver, Remote, retrying

logger = logging.getLogger("gateway.sources")


class RemoteSources:
    def __init__(
        self,
        *,
        remotes: Sequence[Remote],
        cache: AdapterCache,
        check: Callable[[Path], object],
        timeout_s: float,
        prefixes: Sequence[str] = (),
        observer: FetchObserver | None = None,
    ) -> None:
        self._remotes = {remote.scheme: remote for remote in remotes}
        self._cache = cache
        self._check = check
        self._timeout_s = timeout_s
        self._prefixes = tuple(prefixes)
        self._flights: dict[str, _Flight] = {}
        self._observer = observer or NoObserver()

    @property
    def prefixes(self) -> tuple[str, ...]:
        return self._prefixes

    def is_remote(self, src: str) -> bool:
        scheme, separator, _ = src.partition("://")
        return bool(separator) and scheme in self._remotes

    def serves(self, src: object) -> bool:
        return isinstance(src, str) and self.is_remote(src)

    async def resolve(self, src: object) -> Path:
        return await self.fetch(str(src))

    async def fetch(self, src: str) -> Path:
        """The local folder of `src`, held for the caller until `release`."""
        flight = self._flights.get(src)
        if flight is None:
            flight = _Flight(asyncio.ensure_future(self._fetch_bounded(src)))
            self._flights[src] = flight
            flight.task.add_done_callback(lambda _: self._landed(src, flight))
        flight.waiters += 1
        try:
            folder = await asyncio.shield(flight.task)
            self._cache.hold(folder)  # cannot miss: the flight holds it until we leave
            return folder
        finally:
            flight.waiters -= 1
            self._let_go(flight)

    def _landed(self, src: str, flight: _Flight) -> None:
        if self._flights.get(src) is flight:
            del self._flights[src]
        self._let_go(flight)

    def _let_go(self, flight: _Flight) -> None:
        """The flight's own hold goes once it is done and no caller waits for it any more."""
        if flight.released or flight.waiters or not flight.task.done():
            return
        flight.released = True
        if not flight.task.cancelled() and flight.task.exception() is None:
            self._cache.release(flight.task.result())

    def hold(self, folder: Path) -> bool:
        return self._cache.hold(folder)

    def release(self, folder: Path) -> None:
        self._cache.release(folder)

    def keep(self, folders: set[Path]) -> None:
        self._cache.keep(folders)

    async def _fetch_bounded(self, src: str) -> Path:
        scheme = src.partition("://")[0]
        deadline = Deadline.after(self._timeout_s)
        started = time.perf_counter()
        # the thread keeps to the deadline itself; this bounds a call stuck inside a client
        work = asyncio.get_running_loop().run_in_executor(None, self._fetch, src, deadline)
        await asyncio.wait({work}, timeout=self._timeout_s + 1.0)
        if not work.done():
            work.add_done_callback(self._release_late)
            error = AdapterSourceFailed(
                f"The adapter source {src} did not answer within {self._timeout_s:g} s "
                "(LoraConfig.adapterSourceTimeout)", param="src",
            )
            self._failed(scheme, src, error)
            raise error
        try:
            folder, size = work.result()
        except GatewayError as exc:
            self._failed(scheme, src, exc)
            raise
        if size is None:
            self._observer.cached(scheme)
        else:
            self._observer.fetched(scheme, time.perf_counter() - started, size)
            logger.info("adapter source %s fetched: %d bytes into %s", src, size, folder.name)
        return folder

    def _release_late(self, work: asyncio.Future[tuple[Path, int | None]]) -> None:
        """A fetch given up on that still finished: nobody uses its folder."""
        if not work.cancelled() and work.exception() is None:
            self._cache.release(work.result()[0])

    def _failed(self, scheme: str, src: str, error: GatewayError) -> None:
        self._observer.failed(scheme, _outcome(error))
        logger.warning("adapter source %s: %s", src, error.message)

    def _fetch(self, src: str, deadline: Deadline) -> tuple[Path, int | None]:
        """The cached folder (size None) or a fresh download's folder and size, held."""
        remote = self._remotes[src.partition("://")[0]]
        version = retrying(src, deadline, lambda: remote.version(src, deadline))
        key = None if version is None else f"{src}\n{version}"
        cached = None if key is None else self._cache.lookup(key)
        if cached is not None:
            return cached, None
        return self._download(remote, src, key, deadline)

    def _download(
        self, remote: Remote, src: str, key: str | None, deadline: Deadline
    ) -> tuple[Path, int]:
        def attempt() -> tuple[Path, int]:
            staged = self._cache.stage()  # every attempt starts from nothing
            try:
                size = remote.download(src, staged, deadline)
                root = adapter_root(staged)
                self._check(root)
                deadline.check(src)
                return self._cache.commit(key, root, content_digest(root)), size
            finally:
                self._cache.discard(staged)

        return retrying(src, deadline, attempt)


@dataclass(slots=True)
class _Flight:
    """One fetch of a location and the callers waiting for it."""

    task: asyncio.Future[Path]
    waiters: int = 0
    released: bool = False  # its hold of the folder went


def _outcome(error: GatewayError) -> str:
    """A failed fetch's metrics label: missing (nothing there), failed (unreachable, refused,
    too slow) or invalid (what came is not a usable adapter)."""
    if isinstance(error, AdapterSourceMissing):
        return "missing"
    return "failed" if isinstance(error, AdapterSourceFailed) else "invalid"
