"""Safe unpacking of adapter archives (.tar.gz, .tgz, .tar, .zip): regular files and folders
only, no path leaving the archive's root, no links or devices, a bound on the unpacked size."""

from __future__ import annotations

import stat
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from server.core.adapter_files import CONFIG_FILE
from server.core.errors import AdapterInvalid

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
_MAX_MEMBERS = 10_000


def archive_kind(path: str) -> str | None:
    lowered = path.lower()
    return next((suffix for suffix in ARCHIVE_SUFFIXES if lowered.endswith(suffix)), None)


def unpack(archive: Path, kind: str, dest: Path, max_bytes: int) -> Path:
    """Unpack into `dest`; returns the adapter folder (the root, or its single top folder)."""
    try:
        if kind == ".zip":
            _unzip(archive, dest, max_bytes)
        else:
            _untar(archive, dest, max_bytes)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, ValueError) as exc:
        raise AdapterInvalid(f"The adapter archive is corrupt: {exc}", param="src") from None
    return adapter_root(dest)


def adapter_root(folder: Path) -> Path:
    if (folder / CONFIG_FILE).is_file():
        return folder
    entries = list(folder.iterdir())
    if len(entries) == 1 and entries[0].is_dir() and (entries[0] / CONFIG_FILE).is_file():
        return entries[0]
    raise AdapterInvalid(
        f"The adapter source holds no {CONFIG_FILE} at its root or in its single top folder",
        param="src",
    )


def check_member(name: str) -> None:
    """Refuse a member path that is absolute or climbs out of the archive's root."""
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or (path.parts and ":" in path.parts[0]):
        raise AdapterInvalid(f"The adapter archive has an unsafe path: {name[:200]!r}",
                             param="src")


def _untar(archive: Path, dest: Path, max_bytes: int) -> None:
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        _check_count(len(members))
        total = 0
        for member in members:
            check_member(member.name)
            if not (member.isfile() or member.isdir()):
                raise AdapterInvalid(
                    f"The adapter archive has a link or special file: {member.name[:200]!r}",
                    param="src",
                )
            total += member.size
            _check_size(total, max_bytes)
        tar.extractall(dest, members=members, filter="data")


def _unzip(archive: Path, dest: Path, max_bytes: int) -> None:
    with zipfile.ZipFile(archive) as zipped:
        infos = zipped.infolist()
        _check_count(len(infos))
        total = 0
        for info in infos:
            check_member(info.filename)
            if stat.S_ISLNK(info.external_attr >> 16):
                raise AdapterInvalid(
                    f"The adapter archive has a link: {info.filename[:200]!r}", param="src"
                )
            total += info.file_size
            _check_size(total, max_bytes)
        zipped.extractall(dest)


def _check_count(count: int) -> None:
    if count > _MAX_MEMBERS:
        raise AdapterInvalid(f"The adapter archive has more than {_MAX_MEMBERS} entries",
                             param="src")


def _check_size(total: int, max_bytes: int) -> None:
    if total > max_bytes:
        raise AdapterInvalid(
            f"The adapter archive unpacks to more than {max_bytes} bytes (adapterCacheGiB)",
            param="src",
        )
