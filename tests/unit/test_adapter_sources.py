"""Remote adapter sources without a network: safe unpacking, the content-addressed cache, and
the fetcher's one-download-per-location, retries, time bound and error mapping (fake remotes)."""

from __future__ import annotations

import asyncio
import io
import shutil
import tarfile
import threading
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from server.core.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from server.core.adapter_sources import AdapterSourceFailed
from server.core.errors import AdapterInvalid, AdapterSourceMissing
from server.sources.archive import unpack
from server.sources.cache import AdapterCache
from server.sources.fetcher import RemoteSources
from server.sources.remote import Deadline, Transient
from server.sources.s3 import _client_error


def adapter_files(folder: Path, weights: bytes = b"w" * 64) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text('{"r": 8}')
    (folder / WEIGHTS_FILE).write_bytes(weights)
    return folder


def tar_with(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def file_member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


# ---- archives ----------------------------------------------------------------------------------
def test_tar_with_a_single_top_folder_unpacks_to_that_folder(tmp_path: Path) -> None:
    archive = tar_with(tmp_path / "a.tar.gz", [
        file_member("a1/adapter_config.json", b"{}"), file_member("a1/adapter_model.safetensors",
                                                                  b"x"),
    ])
    (tmp_path / "out").mkdir()
    root = unpack(archive, ".tar.gz", tmp_path / "out", 1 << 20)
    assert root == tmp_path / "out" / "a1"
    assert (root / CONFIG_FILE).read_bytes() == b"{}"


@pytest.mark.parametrize("name", ["../evil/adapter_config.json", "/etc/adapter_config.json",
                                  "a/../../adapter_config.json"])
def test_tar_paths_leaving_the_root_are_refused(tmp_path: Path, name: str) -> None:
    archive = tar_with(tmp_path / "a.tar.gz", [file_member(name, b"{}")])
    (tmp_path / "out").mkdir()
    with pytest.raises(AdapterInvalid, match="unsafe path"):
        unpack(archive, ".tar.gz", tmp_path / "out", 1 << 20)
    assert not list((tmp_path / "out").iterdir())


def test_tar_links_are_refused(tmp_path: Path) -> None:
    link = tarfile.TarInfo("adapter_model.safetensors")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    archive = tar_with(tmp_path / "a.tar.gz", [file_member(CONFIG_FILE, b"{}"), (link, None)])
    (tmp_path / "out").mkdir()
    with pytest.raises(AdapterInvalid, match="link"):
        unpack(archive, ".tar.gz", tmp_path / "out", 1 << 20)


def test_zip_paths_and_links_are_refused(tmp_path: Path) -> None:
    escaping = tmp_path / "escape.zip"
    with zipfile.ZipFile(escaping, "w") as zipped:
        zipped.writestr("../adapter_config.json", "{}")
    (tmp_path / "out").mkdir()
    with pytest.raises(AdapterInvalid, match="unsafe path"):
        unpack(escaping, ".zip", tmp_path / "out", 1 << 20)
    linked = tmp_path / "link.zip"
    with zipfile.ZipFile(linked, "w") as zipped:
        info = zipfile.ZipInfo(CONFIG_FILE)
        info.external_attr = (0o120777 << 16)
        zipped.writestr(info, "/etc/passwd")
    with pytest.raises(AdapterInvalid, match="link"):
        unpack(linked, ".zip", tmp_path / "out", 1 << 20)


def test_archives_larger_than_the_budget_unpacked_are_refused(tmp_path: Path) -> None:
    archive = tar_with(tmp_path / "a.tar.gz", [file_member(WEIGHTS_FILE, bytes(4096))])
    (tmp_path / "out").mkdir()
    with pytest.raises(AdapterInvalid, match="more than 1000 bytes"):
        unpack(archive, ".tar.gz", tmp_path / "out", 1000)


def test_corrupt_archives_are_refused(tmp_path: Path) -> None:
    for kind in (".tar.gz", ".zip"):
        archive = tmp_path / f"bad{kind}"
        archive.write_bytes(b"\x1f\x8b not really an archive" * 10)
        (tmp_path / kind).mkdir()
        with pytest.raises(AdapterInvalid, match="corrupt"):
            unpack(archive, kind, tmp_path / kind, 1 << 20)


def test_an_archive_without_a_config_is_refused(tmp_path: Path) -> None:
    archive = tar_with(tmp_path / "a.tar.gz", [file_member("x/y/z.txt", b"1")])
    (tmp_path / "out").mkdir()
    with pytest.raises(AdapterInvalid, match=CONFIG_FILE):
        unpack(archive, ".tar.gz", tmp_path / "out", 1 << 20)


# ---- cache -------------------------------------------------------------------------------------
def test_cache_commits_by_digest_and_finds_it_again_after_a_restart(tmp_path: Path) -> None:
    cache = AdapterCache(tmp_path / "cache", 1 << 20)
    staged = cache.stage()
    adapter_files(staged)
    folder = cache.commit("s3://b/a\nv1", staged, "d" * 64)
    assert folder == tmp_path / "cache" / ("d" * 64)
    assert not staged.exists()
    again = AdapterCache(tmp_path / "cache", 1 << 20)
    assert again.lookup("s3://b/a\nv1") == folder
    assert again.lookup("s3://b/a\nv2") is None


def test_a_restart_drops_unfinished_downloads(tmp_path: Path) -> None:
    cache = AdapterCache(tmp_path / "cache", 1 << 20)
    adapter_files(cache.stage())
    AdapterCache(tmp_path / "cache", 1 << 20)
    assert not list((tmp_path / "cache" / ".staging").iterdir())


def test_cache_evicts_least_recently_used_but_never_a_kept_folder(tmp_path: Path) -> None:
    cache = AdapterCache(tmp_path / "cache", 3000)
    folders = []
    for index in range(3):
        staged = adapter_files(cache.stage(), bytes(1000))
        cache.keep({folders[0]} if folders else set())
        folders.append(cache.commit(f"k{index}", staged, f"{index}" * 64))
    # budget 3000: three entries of ~1008 bytes do not fit; the oldest is kept, the next goes
    assert folders[0].is_dir()
    assert not folders[1].is_dir()
    assert folders[2].is_dir()
    assert cache.lookup("k1") is None


# ---- fetcher -----------------------------------------------------------------------------------
class FakeRemote:
    scheme = "s3"

    def __init__(self, source: Path, *, failures: int = 0, hang: float = 0.0) -> None:
        self.source = source
        self.failures = failures
        self.hang = hang
        self.downloads = 0
        self.lock = threading.Lock()

    def version(self, location: str, deadline: Deadline) -> str | None:
        if not (self.source / location.rsplit("/", 1)[-1]).is_dir():
            raise AdapterSourceMissing(f"No adapter found at {location}")
        return "v1"

    def download(self, location: str, dest: Path, deadline: Deadline) -> int:
        with self.lock:
            self.downloads += 1
            failing = self.failures > 0
            self.failures -= 1
        if self.hang:
            while deadline.remaining() > 0:
                threading.Event().wait(0.05)
            deadline.check(location)
        (dest / CONFIG_FILE).write_text("{}")
        if failing:  # a transfer cut halfway: part of the files, then the connection is gone
            raise Transient("connection reset")
        shutil.copytree(self.source / location.rsplit("/", 1)[-1], dest, dirs_exist_ok=True)
        return 1


def sources(tmp_path: Path, remote: FakeRemote, timeout_s: float = 5.0) -> RemoteSources:
    return RemoteSources(
        remotes=[remote], cache=AdapterCache(tmp_path / "cache", 1 << 20),
        check=lambda folder: (folder / WEIGHTS_FILE).stat(), timeout_s=timeout_s,
    )


def test_concurrent_first_fetches_download_once_and_later_ones_not_at_all(tmp_path: Path) -> None:
    adapter_files(tmp_path / "remote" / "a1")
    remote = FakeRemote(tmp_path / "remote")
    fetcher = sources(tmp_path, remote)

    async def main() -> list[Path]:
        return list(await asyncio.gather(*(fetcher.fetch("s3://b/a1") for _ in range(8))))

    folders = asyncio.run(main())
    assert len(set(folders)) == 1 and remote.downloads == 1
    assert asyncio.run(fetcher.fetch("s3://b/a1")) == folders[0]
    assert remote.downloads == 1


def test_a_cut_transfer_is_retried_from_nothing_and_never_served_half(tmp_path: Path) -> None:
    adapter_files(tmp_path / "remote" / "a1")
    remote = FakeRemote(tmp_path / "remote", failures=2)
    folder = asyncio.run(sources(tmp_path, remote).fetch("s3://b/a1"))
    assert remote.downloads == 3
    assert (folder / WEIGHTS_FILE).read_bytes() == b"w" * 64


def test_a_source_that_hangs_fails_within_its_time_bound_and_caches_nothing(
    tmp_path: Path,
) -> None:
    adapter_files(tmp_path / "remote" / "a1")
    remote = FakeRemote(tmp_path / "remote", hang=1.0)
    with pytest.raises(AdapterSourceFailed, match=r"within 0\.5 s"):
        asyncio.run(sources(tmp_path, remote, timeout_s=0.5).fetch("s3://b/a1"))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".staging", "keys"]
    assert not list((tmp_path / "cache" / ".staging").iterdir())


def test_a_missing_adapter_is_source_missing(tmp_path: Path) -> None:
    fetcher = sources(tmp_path, FakeRemote(tmp_path))
    with pytest.raises(AdapterSourceMissing):
        asyncio.run(fetcher.fetch("s3://b/nowhere"))


def test_only_known_schemes_are_remote(tmp_path: Path) -> None:
    fetcher = sources(tmp_path, FakeRemote(tmp_path))
    assert fetcher.is_remote("s3://b/a1")
    assert not fetcher.is_remote("/srv/adapters/a1")
    assert not fetcher.is_remote("ftp://host/a1")


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [("NoSuchBucket", 404, AdapterSourceMissing), ("AccessDenied", 403, AdapterSourceFailed),
     ("InvalidAccessKeyId", 403, AdapterSourceFailed), ("InternalError", 500, Transient),
     ("SlowDown", 503, Transient), ("InvalidRequest", 400, AdapterSourceFailed)],
)
def test_s3_errors_map_to_missing_refused_or_transient(
    code: str, status: int, kind: type[Exception]
) -> None:
    error = SimpleNamespace(
        response={"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    )
    assert isinstance(_client_error(error, "s3://b/a"), kind)
