"""One registry across workers: an owner and mirrors over a real Unix socket (fake engine)."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from server.core.adapter_files import AdapterRules
from server.core.adapter_state import AdapterJournal
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.core.errors import (
    AdapterExists,
    AdapterInvalid,
    AdapterNotFound,
    Overloaded,
    ServiceUnavailable,
    StateNotSaved,
)
from server.core.peers import Peers, Remote
from server.engines.fake import FakeEngine
from server.runtime.worker_link import MirrorRegistry, OwnerLink, RegistryOwner
from tests.unit.demo_kit import SHAPE, write_adapter

pytestmark = pytest.mark.anyio


@dataclass
class Cluster:
    owner: AdapterRegistry
    engine: FakeEngine
    mirrors: list[MirrorRegistry]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "adapters"
    for name in ("a1", "a2", "a3"):
        write_adapter(folder / name)
    return folder


def _rules(root: Path) -> AdapterRules:
    return AdapterRules(roots=(str(root),), max_rank=8, base_names=frozenset({"tiny"}),
                        base_shape=SHAPE)


def _limits(root: Path, **changes: object) -> AdapterLimits:
    fields: dict[str, object] = {"enabled": True, "max_loras": 1, "max_cpu_loras": 1,
                                 "wait_s": 5.0, "settle_s": 0.0,
                                 "discovery_dirs": (str(root),), "on_demand": True}
    fields.update(changes)
    return AdapterLimits(**fields)  # type: ignore[arg-type]


def _mirror(root: Path, path: Path) -> MirrorRegistry:
    return MirrorRegistry(engine=FakeEngine(model_name="tiny"), rules=_rules(root),
                          limits=_limits(root), link=OwnerLink(path))


@pytest.fixture
async def cluster(root: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    engine = FakeEngine(model_name="tiny")
    path = tmp_path / "registry.sock"
    server = RegistryOwner(path)
    owner = AdapterRegistry(engine=engine, rules=_rules(root), limits=_limits(root),
                            on_change=server.publish)
    await server.start(owner, Peers())
    mirrors = [_mirror(root, path) for _ in range(2)]
    for mirror in mirrors:
        await mirror.link.connect(mirror.show, Peers(), timeout_s=5)
    yield Cluster(owner, engine, mirrors)
    for mirror in mirrors:
        await mirror.link.close()
    await server.close()


async def test_a_registration_on_a_mirror_is_on_every_worker_when_it_answers(
    cluster: Cluster, root: Path
) -> None:
    record = await cluster.mirrors[0].register("n1", str(root / "a1"))
    assert record.name == "n1"
    assert "n1" in cluster.owner.names()
    assert all("n1" in mirror.names() for mirror in cluster.mirrors)
    assert {h.name for h in cluster.engine.adapters.values()} == {"n1"}  # loaded once


async def test_an_unregistration_on_the_owner_is_on_every_mirror_when_it_answers(
    cluster: Cluster, root: Path
) -> None:
    await cluster.owner.register("n1", str(root / "a1"))
    assert all("n1" in mirror.names() for mirror in cluster.mirrors)
    await cluster.owner.unregister("n1")
    assert all("n1" not in mirror for mirror in cluster.mirrors)


async def test_errors_keep_their_type_across_the_link(cluster: Cluster, root: Path) -> None:
    await cluster.owner.register("n1", str(root / "a1"))
    with pytest.raises(AdapterExists):
        await cluster.mirrors[0].register("n1", str(root / "a2"))
    with pytest.raises(AdapterInvalid):
        await cluster.mirrors[0].register("n2", str(root / "missing"))
    with pytest.raises(AdapterNotFound):
        await cluster.mirrors[1].acquire("nothing-here")


async def test_a_mirror_request_is_counted_by_the_owner_until_released(
    cluster: Cluster, root: Path
) -> None:
    await cluster.owner.register("n1", str(root / "a1"))
    handle = await cluster.mirrors[0].acquire("n1")
    assert handle.int_id == cluster.owner.get("n1").handle.int_id
    assert cluster.owner.get("n1").inflight == 1
    cluster.mirrors[0].release(handle, generated_tokens=7)
    await _until(lambda: cluster.owner.get("n1").inflight == 0)
    assert cluster.owner.get("n1").generated_tokens == 7
    await cluster.mirrors[1].refresh()
    assert cluster.mirrors[1].get("n1").requests == 1  # numbers come from the owner


async def test_a_first_request_on_a_mirror_loads_a_dropped_in_folder_once(
    cluster: Cluster,
) -> None:
    handles = await asyncio.gather(*(m.acquire("a2") for m in cluster.mirrors))
    assert handles[0].int_id == handles[1].int_id
    assert cluster.owner.get("a2").loads == 1
    assert all("a2" in mirror.names() for mirror in cluster.mirrors)


async def test_an_abandoned_wait_gives_its_place_back(cluster: Cluster, root: Path) -> None:
    """One engine place: a1 is busy, so a mirror's a2 waits; its caller gives up; the
    owner's late grant is released, so a2 does not stay counted as in use."""
    await cluster.owner.register("a1x", str(root / "a1"))
    busy = await cluster.owner.acquire("a1x")
    waiting = asyncio.create_task(cluster.mirrors[0].acquire("a2"))
    await asyncio.sleep(0.2)
    waiting.cancel()
    cluster.owner.release(busy)
    await _until(lambda: "a2" in cluster.owner.names() and cluster.owner.get("a2").resident)
    await _until(lambda: cluster.owner.get("a2").inflight == 0)


async def test_a_full_engine_answers_overloaded_through_the_link(
    root: Path, tmp_path: Path
) -> None:
    server = RegistryOwner(tmp_path / "r.sock")
    owner = AdapterRegistry(engine=FakeEngine(model_name="tiny"), rules=_rules(root),
                            limits=_limits(root, wait_s=0.1), on_change=server.publish)
    await server.start(owner, Peers())
    mirror = _mirror(root, tmp_path / "r.sock")
    await mirror.link.connect(mirror.show, Peers(), timeout_s=5)
    held = await owner.acquire("a1")
    with pytest.raises(Overloaded):
        await mirror.acquire("a2")
    owner.release(held)
    await mirror.link.close()
    await server.close()


async def test_the_owner_waits_for_mirrors_to_leave(cluster: Cluster, tmp_path: Path) -> None:
    server_gone = RegistryOwner(tmp_path / "other.sock")
    await server_gone.start(cluster.owner, Peers())
    await server_gone.wait_mirrors_gone(0.05)  # none connected: returns at once
    await server_gone.close()


async def _until(condition: object, timeout_s: float = 5.0) -> None:
    assert callable(condition)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_peer_operation_runs_on_every_other_worker_not_the_asker(
    root: Path, tmp_path: Path
) -> None:
    ran: list[str] = []

    def peers_named(name: str, remote: Remote) -> Peers:
        async def echo(value: str) -> str:
            ran.append(name)
            return f"{name}:{value}"

        peers = Peers(remote)
        peers.handle("echo", echo)
        return peers

    server = RegistryOwner(tmp_path / "p.sock")
    owner_peers = peers_named("owner", server.ask_mirrors)
    registry = AdapterRegistry(engine=FakeEngine(model_name="tiny"), rules=_rules(root),
                               limits=_limits(root), on_change=server.publish)
    await server.start(registry, owner_peers)
    mirrors, mirror_peers = [], []
    for index in range(2):
        mirror = _mirror(root, tmp_path / "p.sock")
        peers = peers_named(f"mirror-{index}", mirror.link.ask_owner)
        await mirror.link.connect(mirror.show, peers, timeout_s=5)
        mirrors.append(mirror)
        mirror_peers.append(peers)
    from_mirror = await mirror_peers[0].ask("echo", "x")
    from_owner = await owner_peers.ask("echo", "y")
    assert sorted(from_mirror) == ["mirror-1:x", "owner:x"]
    assert sorted(from_owner) == ["mirror-0:y", "mirror-1:y"]
    assert await mirror_peers[1].ask("unknown-op") == [None, None]
    assert await Peers().ask("echo", "z") == []  # one process: nobody to ask
    assert sorted(ran) == ["mirror-0", "mirror-1", "mirror-1", "owner"]
    for mirror in mirrors:
        await mirror.link.close()
    await server.close()


async def test_a_change_the_owner_cannot_save_is_refused_on_every_worker_unchanged(
    cluster: Cluster, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = AdapterJournal(tmp_path / "state" / "adapters.json")
    journal.load()
    cluster.owner._changes.journal = journal  # the owner alone writes the state file
    await cluster.mirrors[0].register("kept", str(root / "a1"))
    monkeypatch.setattr(os, "open", _read_only)
    for mirror in cluster.mirrors:
        with pytest.raises(StateNotSaved, match="read-only file system"):
            await mirror.register("refused", str(root / "a2"))
        with pytest.raises(StateNotSaved):
            await mirror.unregister("kept")
    assert cluster.owner.names() == ["kept"]
    assert all(mirror.names() == ["kept"] for mirror in cluster.mirrors)


def _read_only(*_: object, **__: object) -> int:
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))


# uvloop (the workers' loop) keeps the write side of a socket its peer closed open until a
# write fails: the first call after the owner went away was written and waited for ever
@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True}), "asyncio"])
async def test_calls_after_the_owner_went_away_fail_at_once(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Once the link is lost, every call gets the same ServiceUnavailable at once; none waits
    for a reply that cannot come."""
    server = RegistryOwner(tmp_path / "gone.sock")
    owner = AdapterRegistry(engine=FakeEngine(model_name="tiny"), rules=_rules(root),
                            limits=_limits(root), on_change=server.publish)
    await server.start(owner, Peers())
    mirror = _mirror(root, tmp_path / "gone.sock")
    await mirror.link.connect(mirror.show, Peers(), timeout_s=5)
    await server.close()
    await _until(lambda: "the adapter registry's owner went away" in caplog.text)
    calls = [mirror.register("late", str(root / "a1")), mirror.unregister("a1"),
             mirror.acquire("a2"), mirror.link.ask_owner("echo", ())]
    for call in calls:
        with pytest.raises(ServiceUnavailable, match="the adapter registry is not reachable"):
            await asyncio.wait_for(call, 10.0)  # a guard: before the fix they waited for ever
    await mirror.link.close()


async def test_an_owner_gone_before_its_first_view_fails_the_start(
    root: Path, tmp_path: Path
) -> None:
    """A mirror whose owner accepted it, then went away before sending a view, stops waiting
    for that view: its start fails with ServiceUnavailable (before, it waited for ever)."""
    async def leave(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    path = tmp_path / "early.sock"
    server = await asyncio.start_unix_server(leave, str(path))
    mirror = _mirror(root, path)
    with pytest.raises(ServiceUnavailable, match="went away while starting"):
        await asyncio.wait_for(mirror.link.connect(mirror.show, Peers(), timeout_s=5), 10.0)
    server.close()
    await mirror.link.close()


async def test_an_owner_that_sends_no_view_fails_the_start_in_time(
    root: Path, tmp_path: Path
) -> None:
    """Connected but never shown a view, a mirror gives up when its start time is up."""
    silent: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        silent.append(writer)

    path = tmp_path / "silent.sock"
    server = await asyncio.start_unix_server(hold, str(path))
    mirror = _mirror(root, path)
    with pytest.raises(ServiceUnavailable, match="sent no view"):
        await asyncio.wait_for(mirror.link.connect(mirror.show, Peers(), timeout_s=0.5), 10.0)
    for writer in silent:
        writer.close()
    server.close()
    await mirror.link.close()
