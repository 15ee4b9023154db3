"""The local adapter cache: complete, validated adapter folders named by their content digest.

A download is staged under `.staging/` and renamed to `<digest>/` only once it is complete and
valid, so a partial download is never served, listed or reused. `keys/` maps a source's identity
(its location and version) to a digest, so a restart reuses what was fetched before. Entries are
evicted least recently used (folder mtime) beyond the size budget, never one the registry keeps
(loaded or pinned) nor one held: a folder found or committed is held for its fetch's callers
until they release it (registered and loaded, or given up), so a folder another request just
fetched is never deleted before the engine read it. When only kept or held folders are left the
cache stays over its budget until they are released.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections import Counter
from pathlib import Path

logger = logging.getLogger("gateway.sources")

STAGING = ".staging"
KEYS = "keys"


class AdapterCache:
    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self._kept: frozenset[Path] = frozenset()
        self._holds: Counter[Path] = Counter()  # resolved folder -> callers using it now
        self._lock = threading.Lock()  # commits and evictions, one at a time (threads only)
        # holds, and an eviction's rename of a folder not held: short, so the event loop may
        # wait for it (a folder is either held before it is renamed away, or no longer there)
        self._holds_lock = threading.Lock()
        (root / STAGING).mkdir(parents=True, exist_ok=True)
        (root / KEYS).mkdir(exist_ok=True)
        self._clear_staging()

    def lookup(self, key: str) -> Path | None:
        """The cached folder for a source identity, if it is still there: marked as used and
        held (see `release`)."""
        try:
            digest = (self.root / KEYS / _key_name(key)).read_text().strip()
        except OSError:
            return None
        if not digest:
            return None
        folder = self.root / digest
        if not self.hold(folder):
            return None
        _touch(folder)
        return folder

    def hold(self, folder: Path) -> bool:
        """Hold `folder` (never evicted until `release`) if it is still there."""
        with self._holds_lock:
            if not folder.is_dir():
                return False
            self._holds[folder.resolve()] += 1
            return True

    def release(self, folder: Path) -> None:
        """One hold of `folder` less (from `hold`, `lookup` or `commit`)."""
        with self._holds_lock:
            resolved = folder.resolve()
            self._holds[resolved] -= 1
            if self._holds[resolved] <= 0:
                del self._holds[resolved]

    def held(self) -> set[Path]:
        with self._holds_lock:
            return set(self._holds)

    def stage(self) -> Path:
        """A new empty folder to download into (removed by `discard` or moved by `commit`)."""
        return Path(tempfile.mkdtemp(dir=self.root / STAGING))

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def commit(self, key: str | None, folder: Path, digest: str) -> Path:
        """Move a complete, validated folder to its digest's place (kept if one is there) and
        remember `key` for it; then evict beyond the budget. The folder returned is held (see
        `release`)."""
        target = self.root / digest
        with self._lock:
            if target.is_dir():
                shutil.rmtree(folder, ignore_errors=True)
            else:
                _fsync_tree(folder)
                os.replace(folder, target)
                _fsync_dir(self.root)
            _touch(target)
            with self._holds_lock:  # before an eviction may look at it
                self._holds[target.resolve()] += 1
            if key is not None:
                _write_atomic(self.root / KEYS / _key_name(key), digest)
        self.evict()
        return target

    def keep(self, folders: set[Path]) -> None:
        self._kept = frozenset(folder.resolve() for folder in folders)

    def evict(self) -> None:
        """Remove least recently used entries, neither kept nor held, until the cache fits its
        budget."""
        with self._lock:
            entries = sorted(self._entries(), key=lambda e: e[1])
            total = sum(size for _, _, size in entries)
            for folder, _, size in entries:
                if total <= self.budget_bytes:
                    break
                doomed = self._take_unless_used(folder)
                if doomed is None:
                    continue
                shutil.rmtree(doomed, ignore_errors=True)
                total -= size
                logger.info("adapter cache: evicted %s (%d bytes)", folder.name, size)

    def _take_unless_used(self, folder: Path) -> Path | None:
        """Move `folder` out of the cache (to be deleted) unless it is kept or held."""
        with self._holds_lock:
            resolved = folder.resolve()
            if resolved in self._kept or resolved in self._holds:
                return None
            doomed = Path(tempfile.mkdtemp(dir=self.root / STAGING)) / folder.name
            try:
                os.replace(folder, doomed)
            except OSError:
                return None
            return doomed.parent

    def size(self) -> int:
        return sum(size for _, _, size in self._entries())

    def _entries(self) -> list[tuple[Path, float, int]]:
        found = []
        for entry in self.root.iterdir():
            if entry.name in (STAGING, KEYS) or not entry.is_dir():
                continue
            with contextlib.suppress(OSError):
                size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
                found.append((entry, entry.stat().st_mtime, size))
        return found

    def _clear_staging(self) -> None:
        """Downloads a previous process left unfinished are never resumed or served."""
        for entry in (self.root / STAGING).iterdir():
            shutil.rmtree(entry, ignore_errors=True)


def _key_name(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _touch(folder: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(folder)


def _write_atomic(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    with temporary.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_dir(path.parent)


def _fsync_tree(folder: Path) -> None:
    for file in folder.rglob("*"):
        if file.is_file():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
