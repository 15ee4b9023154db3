"""Remote adapter sources without a network: safe unpacking, the content-addressed cache and
its holds, the fetcher's one-download-per-location, retries, time bound and error mapping (fake
remotes), and the registry over them with a small cache (the fake engine)."""

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

from server.core.adapter_files import CONFIG_FILE, WEIGHTS_FILE, AdapterRules, validate_adapter_dir
from server.core.adapter_sources import AdapterSourceFailed
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.core.errors import AdapterInvalid, AdapterSourceMissing
from server.core.types import AdapterHandle
from server.engines.fake import FakeEngine
from server.sources.archive import unpack
from server.sources.cache import AdapterCache
from server.sources.fetcher import RemoteSources
from server.sources.remote import Deadline, Transient
from server.sources.s3 import _client_error
from tests.unit.demo_kit import SHAPE, write_adapter


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
        cache.release(folders[-1])  # its caller is done with it
    # budget 3000: three entries of ~1008 bytes do not fit; the oldest is kept, the next goes
    assert folders[0].is_dir()
    assert not folders[1].is_dir()
    assert folders[2].is_dir()
    assert cache.lookup("k1") is None


def test_a_held_folder_is_never_evicted_and_goes_once_released(tmp_path: Path) -> None:
    """A folder fetched for a load is held until the load is done: other commits (and their
    evictions) leave it alone, the cache over its budget meanwhile."""
    cache = AdapterCache(tmp_path / "cache", 1500)
    first = cache.commit("k0", adapter_files(cache.stage(), bytes(1000)), "0" * 64)
    second = cache.commit("k1", adapter_files(cache.stage(), bytes(1000)), "1" * 64)
    assert first.is_dir() and second.is_dir()  # both held: over the budget, nothing deleted
    assert cache.lookup("k0") == first  # held twice now
    cache.release(first)
    cache.release(second)
    cache.evict()
    assert first.is_dir() and not second.is_dir()  # `first` is still held by its lookup
    cache.release(first)
    assert cache.held() == set()
    third = cache.commit("k2", adapter_files(cache.stage(), bytes(1000)), "2" * 64)
    assert not first.is_dir() and third.is_dir()
    assert not cache.hold(first)  # gone: a hold says so instead of pointing at nothing


# ---- fetcher -----------------------------------------------------------------------------------
class FakeRemote:
    scheme = "s3"

    def __init__(
        self, source: Path, *, failures: int = 0, hang: float = 0.0,
        gate: threading.Event | None = None,
    ) -> None:
        self.source = source
        self.failures = failures
        self.hang = hang
        self.gate = gate  # a download waits until it is set (a slow store)
        self.downloads = 0
        self.started = threading.Event()  # a download began
        self.versions = 0
        self.lock = threading.Lock()

    def version(self, location: str, deadline: Deadline) -> str | None:
        if not (self.source / location.rsplit("/", 1)[-1]).is_dir():
            raise AdapterSourceMissing(f"No adapter found at {location}")
        with self.lock:
            self.versions += 1
        return "v1"

    def download(self, location: str, dest: Path, deadline: Deadline) -> int:
        with self.lock:
            self.downloads += 1
            failing = self.failures > 0
            self.failures -= 1
        self.started.set()
        if self.gate is not None:
            self.gate.wait(30)
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


def test_each_caller_of_a_shared_fetch_holds_the_folder_until_it_releases_it(
    tmp_path: Path,
) -> None:
    adapter_files(tmp_path / "remote" / "a1")
    fetcher = sources(tmp_path, FakeRemote(tmp_path / "remote"))
    cache = fetcher._cache

    async def main() -> list[Path]:
        return list(await asyncio.gather(*(fetcher.fetch("s3://b/a1") for _ in range(3))))

    folders = asyncio.run(main())
    assert cache._holds[folders[0].resolve()] == 3  # the fetch's own hold went
    for folder in folders:
        fetcher.release(folder)
    assert cache.held() == set()


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


def test_a_fetch_given_up_on_that_finishes_later_holds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit stuck past the time bound (a slow disk): the caller got its error, and the
    folder committed afterwards is not held by anyone (so it may be evicted)."""
    adapter_files(tmp_path / "remote" / "a1")
    fetcher = sources(tmp_path, FakeRemote(tmp_path / "remote"), timeout_s=0.1)
    cache = fetcher._cache
    gate, committed = threading.Event(), threading.Event()
    commit = cache.commit

    def slow_commit(key: str | None, folder: Path, digest: str) -> Path:
        gate.wait(30)
        try:
            return commit(key, folder, digest)
        finally:
            committed.set()

    monkeypatch.setattr(cache, "commit", slow_commit)

    async def main() -> None:
        with pytest.raises(AdapterSourceFailed):
            await fetcher.fetch("s3://b/a1")
        gate.set()
        await asyncio.to_thread(committed.wait, 30)
        await asyncio.sleep(0.05)  # the late result's callback runs on the loop

    asyncio.run(main())
    assert len(list((tmp_path / "cache").glob("[0-9a-f]" * 64))) == 1
    assert cache.held() == set()


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


# ---- the registry over remote sources and a small cache ---------------------------------------
class ReadingEngine(FakeEngine):
    """Reads an adapter's folder as vLLM's add_lora does, a moment after being asked."""

    async def add_adapter(
        self, adapter: AdapterHandle, *, evicting: AdapterHandle | None = None
    ) -> None:
        await asyncio.sleep(0.005)
        if not (Path(adapter.path) / WEIGHTS_FILE).is_file():
            raise AdapterInvalid(f"Loading lora {adapter.name} failed: No adapter found for "
                                 f"{adapter.path}")
        await super().add_adapter(adapter, evicting=evicting)


class Fleet:
    """A registry whose unknown names are looked up in a fake S3 store (`store/<name>`), with
    local adapters in `local/` and a cache of `budget` bytes (a demo adapter is ~4 KB)."""

    def __init__(
        self, tmp_path: Path, *, budget: int, gate: threading.Event | None = None,
        max_cpu_loras: int = 4,
    ) -> None:
        self.store, self.local = tmp_path / "store", tmp_path / "local"
        self.local.mkdir()
        self.remote = FakeRemote(self.store, gate=gate)
        self.cache = AdapterCache(tmp_path / "cache", budget)
        rules = AdapterRules(roots=(str(tmp_path),), max_rank=8, base_names=frozenset({"tiny"}),
                             base_shape=SHAPE)
        fetcher = RemoteSources(
            remotes=[self.remote], cache=self.cache, timeout_s=60.0, prefixes=("s3://b/",),
            check=lambda folder: validate_adapter_dir(folder, rules),
        )
        limits = AdapterLimits(enabled=True, max_loras=2, max_cpu_loras=max_cpu_loras,
                               wait_s=30.0, settle_s=0.0, discovery_dirs=(str(self.local),))
        self.registry = AdapterRegistry(engine=ReadingEngine(model_name="tiny"), rules=rules,
                                        limits=limits, fetcher=fetcher)

    def stored(self, *names: str) -> list[str]:
        for name in names:
            write_adapter(self.store / name)
        return list(names)

    async def use(self, name: str) -> None:
        handle = await self.registry.acquire(name)
        await asyncio.sleep(0.002)
        self.registry.release(handle)


def copy_present(fleet: Fleet, name: str) -> bool:
    return Path(fleet.registry.get(name).handle.path).is_dir()


def cached_copies(fleet: Fleet) -> int:
    return len(list(fleet.cache.root.glob("[0-9a-f]" * 64)))


def test_evicted_remote_copies_are_no_change_for_the_folder_scan(tmp_path: Path) -> None:
    """With more remote adapters registered than the cache holds, the periodic scan fetches
    nothing (it was an endless download loop); an evicted copy is fetched by its next use."""
    fleet = Fleet(tmp_path, budget=6000, max_cpu_loras=2)
    names = fleet.stored(*(f"r{index}" for index in range(6)))

    async def main() -> None:
        for name in names:
            await fleet.use(name)
        assert cached_copies(fleet) < len(names)
        downloads, versions = fleet.remote.downloads, fleet.remote.versions
        for _ in range(3):
            report = await fleet.registry.sync_folders()
            assert report.reloaded == () and report.removed == ()
        assert (fleet.remote.downloads, fleet.remote.versions) == (downloads, versions)
        evicted = [n for n in names if not copy_present(fleet, n)]
        assert evicted
        await fleet.use(evicted[0])
        assert fleet.remote.downloads == downloads + 1
        assert copy_present(fleet, evicted[0])

    asyncio.run(main())
    assert fleet.cache.held() == set()


@pytest.mark.parametrize("refetch", ["acquire", "reload_changed"])
def test_a_slow_store_never_holds_up_local_adapters(tmp_path: Path, refetch: str) -> None:
    """A remote adapter fetched again from a store that does not answer: local adapters that
    are not loaded yet load meanwhile (the fetch runs outside the registry's lock)."""
    gate = threading.Event()
    gate.set()
    fleet = Fleet(tmp_path, budget=1 << 20, gate=gate)
    fleet.stored("r1")
    for name in ("l1", "l2", "l3"):
        write_adapter(fleet.local / name)

    async def main() -> None:
        registry = fleet.registry
        await registry.register("r1", "s3://b/r1", preload=False)
        shutil.rmtree(registry.get("r1").handle.path)  # its cached copy was evicted
        gate.clear()
        fleet.remote.started.clear()
        fetching = asyncio.ensure_future(getattr(registry, refetch)("r1"))
        assert await asyncio.to_thread(fleet.remote.started.wait, 30)
        for name in ("l1", "l2", "l3"):
            await fleet.use(name)
        assert not fetching.done()  # the store still has not answered
        gate.set()
        await fetching
        await fleet.use("r1")

    asyncio.run(main())
    assert fleet.cache.held() == set()


def test_concurrent_first_uses_with_a_full_cache_all_load(tmp_path: Path) -> None:
    """12 new remote adapters named at once, 3 requests each, with a cache that holds about
    one: every request is served (a folder fetched is never evicted before the engine read
    it), and afterwards nothing is held."""
    fleet = Fleet(tmp_path, budget=6000)
    names = fleet.stored(*(f"n{index}" for index in range(12)))

    async def main() -> list[BaseException | None]:
        jobs = [fleet.use(name) for name in names for _ in range(3)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    results = asyncio.run(main())
    assert [r for r in results if r is not None] == []
    assert fleet.cache.held() == set()
    assert all(fleet.registry.get(name).loads >= 1 for name in names)
