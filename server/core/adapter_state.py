"""The adapter state file (`LoraConfig.stateFile`): runtime registrations that survive a restart.

Only adapters registered through a management API are kept (the config file and `adapterDir`
bring theirs back by themselves): name, src, pin, preload and options.

The file is a journal: one line per change (`<crc32 hex> <json>`), appended and fsynced before
the change is answered, so a change costs the same however many adapters exist. When the file
holds more than twice the live set (plus `COMPACT_SLACK` lines) it is rewritten as the live set
alone: a temporary file in the same folder, fsynced, renamed over the journal, then the folder
fsynced. A compaction that fails changes nothing (the appended line already made the change
durable): it is logged and tried again after a later change.

A crash can tear only the last line (every earlier one was fsynced): a last line that is cut
short or fails its checksum is ignored with a warning, and the next change rewrites the file
without it. The header is written whole (by a rename, never appended), so only a file that
starts with it is a journal: any other file at that path is not ours, and stops the start
rather than being overwritten. Whitespace at line ends (CRLF) and blank lines at the end of
the file are ignored. Damage anywhere else fails start-up, naming the file and the fix: losing
registrations silently would be worse than stopping. The version 1 format (one JSON document,
rewritten whole) is still read, and rewritten as a journal by the first change.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import tempfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from server.core.errors import StateNotSaved

logger = logging.getLogger("gateway.adapters")

VERSION = 2
LEGACY_VERSION = 1
HEADER = {"journal": "llm-gateway adapter state", "version": VERSION}
COMPACT_SLACK = 64  # lines beyond twice the live set before a compaction


class StateFileError(ValueError):
    """The state file exists but is not a state this server wrote."""


@dataclass(frozen=True, slots=True)
class SavedAdapter:
    name: str
    src: str
    pin: bool = False
    preload: bool = True
    options: dict[str, str] = field(default_factory=dict)


class AdapterJournal:
    """The saved registrations and the file that keeps them. Not thread-safe: the registry
    calls it one change at a time (under its lock)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._live: dict[str, SavedAdapter] = {}
        self._lines = 0  # change lines in the file (the header not counted)
        self._rewrite = True  # the next change rewrites the file: none yet, v1, torn or failed
        self._warnings: list[str] = []  # found reading the file; logged by `load` alone

    def load(self) -> list[SavedAdapter]:
        """Read the file (absent: no registrations; its folder is made now, never later: a
        folder that vanishes while serving refuses changes). Raises StateFileError when it is
        not a state this server wrote, or is damaged before its last line."""
        saved = self._read()
        for warning in self._warnings:
            logger.warning("%s", warning)
        return saved

    def _read(self) -> list[SavedAdapter]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._warnings.append(
                    f"the state file's folder {self.path.parent} cannot be made (adapter changes "
                    f"are refused until it can be written): {exc}"
                )
        except OSError as exc:
            raise _damaged(self.path, f"cannot be read ({exc.strerror})") from None
        self._remove_temporaries()
        if data.lstrip().startswith(b"{"):
            self._live = {a.name: a for a in _read_legacy(self.path, data)}
            self._rewrite = True
        else:
            self._replay(data)
        return list(self._live.values())

    def _remove_temporaries(self) -> None:
        """Compactions a crash interrupted leave their temporary file: never read, removed."""
        for stale in self.path.parent.glob(f".{self.path.name}.*"):
            try:
                stale.unlink()
            except OSError as exc:
                logger.warning("cannot remove %s: %s", stale, exc)

    def saved(self) -> list[SavedAdapter]:
        return list(self._live.values())

    def set(self, name: str, adapter: SavedAdapter | None, *, strict: bool = True) -> None:
        """Make `name` saved as `adapter` (None: not saved), durably, before returning.

        strict: raise StateNotSaved when it cannot be written, and keep the previous state.
        Not strict (undoing a change already saved): take the new state anyway; if it cannot
        be written, log it and rewrite the whole file at the next change.
        """
        if self._live.get(name) == adapter:
            return
        change: dict[str, Any] = {"put": asdict(adapter)} if adapter else {"delete": name}
        live = dict(self._live)
        if adapter is None:
            live.pop(name, None)
        else:
            live[name] = adapter
        try:
            self._write(change, live)
        except OSError as exc:
            self._rewrite = True
            if strict:
                logger.error("adapter %s: the state file %s cannot be written: %s",
                             name, self.path, exc)
                raise StateNotSaved.from_os_error(exc) from None
            logger.error("adapter %s: undoing a change, the state file %s cannot be written "
                         "(rewritten whole at the next change): %s", name, self.path, exc)
        self._live = live
        self._compact_if_long()

    # ---- writing -----------------------------------------------------------------------------
    def _write(self, change: dict[str, Any], live: dict[str, SavedAdapter]) -> None:
        if not self._rewrite:
            try:
                self._append(change)
                return
            except FileNotFoundError:
                pass  # the file was removed: the live set is all there is, rewrite it
        self._rewrite_whole(live)

    def _append(self, change: dict[str, Any]) -> None:
        line = _line(change)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)  # never creates: see `_write`
        try:
            size = os.fstat(fd).st_size
            try:
                _write_all(fd, line)
                os.fsync(fd)
            except OSError:
                _cut_back(fd, size)
                raise
        finally:
            os.close(fd)
        self._lines += 1

    def _rewrite_whole(self, live: dict[str, SavedAdapter]) -> None:
        """The live set as a new file: temporary, fsynced, renamed, folder fsynced."""
        body = _line(HEADER) + b"".join(_line({"put": asdict(a)}) for a in live.values())
        folder = self.path.parent
        handle, temporary = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=folder)
        try:
            try:
                _write_all(handle, body)
                os.fsync(handle)
            finally:
                os.close(handle)
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        _fsync_folder(folder)
        self._lines, self._rewrite = len(live), False

    def _compact_if_long(self) -> None:
        if self._rewrite or self._lines <= 2 * len(self._live) + COMPACT_SLACK:
            return
        try:
            self._rewrite_whole(self._live)
        except OSError as exc:  # the journal still holds every change: try after the next one
            logger.warning("the state file %s could not be compacted: %s", self.path, exc)

    # ---- reading -----------------------------------------------------------------------------
    def _replay(self, data: bytes) -> None:
        lines = [line.rstrip() for line in data.split(b"\n")]
        while lines and not lines[-1]:
            lines.pop()  # blank lines and whitespace at the end: an editor's, not a change
        # a file not exactly as this server writes it (a torn change, whitespace, CRLF, none
        # yet) is rewritten whole by the next change, never appended to
        self._rewrite = b"".join(line + b"\n" for line in lines) != data or not lines
        if not lines:
            return
        changes = [_parse(line) for line in lines]
        _check_header(self.path, changes[0])
        if len(changes) > 1 and changes[-1] is None:
            # the header proves the file is a journal: only then is a bad last line torn
            self._warnings.append(
                f"the state file {self.path} ends with a torn change (the server stopped while "
                "writing it, before answering it): ignored"
            )
            self._rewrite = True
            changes.pop()
        for number, change in enumerate(changes[1:], start=2):
            if change is None:
                raise _damaged(self.path, f"line {number} is damaged (checksum or JSON)")
            self._apply(number, change)
        self._lines = len(changes) - 1

    def _apply(self, number: int, change: Any) -> None:
        if isinstance(change, dict) and set(change) == {"put"}:
            adapter = _entry(self.path, f"line {number}", change["put"])
            self._live[adapter.name] = adapter
        elif isinstance(change, dict) and set(change) == {"delete"} and isinstance(
            change["delete"], str
        ):
            self._live.pop(change["delete"], None)
        else:
            raise _damaged(self.path, f"line {number} is neither a put nor a delete")


def _line(record: dict[str, Any]) -> bytes:
    payload = json.dumps(record, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


def _parse(line: bytes) -> Any:
    """The change of one line; None when its checksum or JSON is wrong."""
    checksum, _, payload = line.partition(b" ")
    try:
        if int(checksum, 16) != zlib.crc32(payload) or len(checksum) != 8:
            return None
        return json.loads(payload)
    except ValueError:
        return None


def _check_header(path: Path, first: Any) -> None:
    """Only a file whose first line is a journal header is a state this server wrote (it
    writes the header whole, by a rename): any other file is never replayed nor overwritten."""
    if first is None:
        raise _damaged(
            path, "is not an adapter state journal (its first line is not a journal header)",
            fix="point LoraConfig.stateFile at a file of its own (the server creates it), or "
            "move this file away if it is a damaged state file",
        )  # fmt: skip
    if first != HEADER:
        raise _damaged(path, f"does not start with a version {VERSION} header")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


def _cut_back(fd: int, size: int) -> None:
    """Remove a partly appended line, so a later append is not glued to it."""
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    except OSError:
        pass  # the caller marks the file for a whole rewrite at the next change


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_legacy(path: Path, data: bytes) -> list[SavedAdapter]:
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise _damaged(path, f"is not valid JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("version") != LEGACY_VERSION:
        raise _damaged(path, 'is not a version 1 state ({"version": 1, "adapters": []})')
    entries = document.get("adapters")
    if not isinstance(entries, list):
        raise _damaged(path, "has no 'adapters' list")
    return [_entry(path, f"adapters[{index}]", item) for index, item in enumerate(entries)]


def _entry(path: Path, where: str, item: object) -> SavedAdapter:
    if not isinstance(item, dict):
        raise _damaged(path, f"{where} is not an object")
    name, src = item.get("name"), item.get("src")
    pin, preload = item.get("pin", False), item.get("preload", True)
    options = item.get("options", {})
    valid = (
        isinstance(name, str) and isinstance(src, str) and isinstance(pin, bool)
        and isinstance(preload, bool) and isinstance(options, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in options.items())
    )  # fmt: skip
    if not valid:
        raise _damaged(
            path, f"{where} needs name and src strings, pin and preload booleans, "
            "options of strings",
        )  # fmt: skip
    return SavedAdapter(str(name), str(src), bool(pin), bool(preload), dict(options))


REPAIR = (
    "repair the file, or move it away to start without the runtime adapter registrations it held"
)


def _damaged(path: Path, problem: str, fix: str = REPAIR) -> StateFileError:
    return StateFileError(f"LoraConfig.stateFile: {path} {problem}. Fix: {fix}")


def read_state(path: Path) -> list[SavedAdapter]:
    """The saved registrations; [] when the file does not exist yet. What is wrong but not
    fatal (a torn last change) is not logged here: the registry's journal, which reads the
    file again and acts on it, says it once."""
    return AdapterJournal(path)._read()
