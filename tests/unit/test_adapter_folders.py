"""Adapters as operators run them, in process on the fake engine: identity by content, loading
on first request, the folder kept in sync, the state file.

The real-engine proofs through the official clients are in tests/conformance/test_adapter_dir.py.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from server.core import adapter_files
from server.core.adapter_files import AdapterRules
from server.core.adapter_state import SavedAdapter, StateFileError, read_state
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.core.errors import AdapterInvalid, AdapterNotFound
from server.engines.fake import FakeEngine
from tests.unit.demo_kit import SHAPE, write_adapter

pytestmark = pytest.mark.anyio


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    for name in ("a1", "a2"):
        write_adapter(root / name)
    return root


def registry_for(
    folder: Path, *, on_demand: bool = True, state: Path | None = None,
    engine: FakeEngine | None = None,
) -> tuple[AdapterRegistry, FakeEngine]:
    engine = engine or FakeEngine(model_name="tiny")
    rules = AdapterRules(roots=(str(folder), str(folder.parent / "elsewhere")), max_rank=8,
                         base_names=frozenset({"tiny"}), base_shape=SHAPE)
    limits = AdapterLimits(enabled=True, max_loras=2, max_cpu_loras=4, wait_s=5.0, settle_s=0.0,
                           discovery_dirs=(str(folder),), on_demand=on_demand)
    return AdapterRegistry(engine=engine, rules=rules, limits=limits, state_file=state), engine


def change_weights(path: Path) -> None:
    """Other contents, same layout: flip the config's revision."""
    config_path = path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["revision"] = config["revision"] + "-v2"
    config_path.write_text(json.dumps(config))


# ---- identity by content ---------------------------------------------------------------------
async def test_the_same_files_under_two_names_share_one_engine_place(
    folder: Path, tmp_path: Path
) -> None:
    registry, engine = registry_for(folder)
    copy = tmp_path / "elsewhere" / "same"
    shutil.copytree(folder / "a1", copy)
    first = await registry.register("a1", str(folder / "a1"))
    second = await registry.register("twin", str(copy))
    assert first.handle.int_id == second.handle.int_id
    assert len(engine.adapters) == 1 and second.resident


async def test_re_registering_a_name_with_other_files_never_serves_the_old_ones(
    folder: Path,
) -> None:
    registry, engine = registry_for(folder)
    old = (await registry.register("x", str(folder / "a1"))).handle.int_id
    await registry.unregister("x")
    await asyncio.sleep(0.01)
    new = (await registry.register("x", str(folder / "a2"))).handle.int_id
    assert new != old
    handle = await registry.acquire("x")
    assert handle.int_id == new and engine.adapters[new].path.endswith("a2")


async def test_files_changed_in_place_are_a_new_identity_on_the_next_request(
    folder: Path,
) -> None:
    registry, engine = registry_for(folder)
    await registry.register("a1", str(folder / "a1"))
    before = (await registry.acquire("a1"))
    registry.release(before)
    change_weights(folder / "a1")
    after = await registry.acquire("a1")
    assert after.int_id != before.int_id
    assert after.int_id in engine.adapters
    registry.release(after)


def writing_while(
    monkeypatch: pytest.MonkeyPatch, path: Path, times: int, *, obj: object, name: str
) -> None:
    """A writer at work: the weights at `path` change just after each of the first `times`
    reads by `obj.name` (what was read is the files before the write)."""
    original = getattr(obj, name)
    calls = [0]

    def wrote() -> None:
        calls[0] += 1
        if calls[0] <= times:
            change_weights(path)

    def meanwhile(*args: object, **kwargs: object) -> object:
        result = original(*args, **kwargs)
        wrote()
        return result

    async def meanwhile_async(*args: object, **kwargs: object) -> object:
        result = await original(*args, **kwargs)
        wrote()
        return result

    wrapped = meanwhile_async if asyncio.iscoroutinefunction(original) else meanwhile
    monkeypatch.setattr(obj, name, wrapped)


READERS = ["content_digest", "add_adapter"]  # the gateway's validation, the engine's load


@pytest.mark.parametrize("reader", READERS)
async def test_files_written_while_they_are_read_are_read_again(
    folder: Path, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    registry, engine = registry_for(folder)
    writer_at = adapter_files if reader == "content_digest" else engine
    writing_while(monkeypatch, folder / "a1", 1, obj=writer_at, name=reader)
    record = await registry.register("a1", str(folder / "a1"))
    monkeypatch.undo()
    # the engine holds the written files under their own identity, and nothing else
    assert record.digest == adapter_files.content_digest(folder / "a1")
    assert record.fingerprint == adapter_files.fingerprint(folder / "a1")
    assert list(engine.adapters) == [record.handle.int_id] and record.resident


@pytest.mark.parametrize("reader", READERS)
async def test_files_that_keep_changing_while_they_are_read_are_refused(
    folder: Path, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    registry, engine = registry_for(folder)
    await registry.register("a1", str(folder / "a1"), preload=False)
    change_weights(folder / "a1")
    writer_at = adapter_files if reader == "content_digest" else engine
    writing_while(monkeypatch, folder / "a1", 99, obj=writer_at, name=reader)
    with pytest.raises(AdapterInvalid, match="kept changing"):
        await registry.acquire("a1")
    assert engine.adapters == {}


# ---- load on first request -------------------------------------------------------------------
async def test_a_dropped_in_folder_is_known_and_loads_once_on_concurrent_first_requests(
    folder: Path,
) -> None:
    registry, _ = registry_for(folder)
    write_adapter(folder / "fresh")
    assert "fresh" in registry and "fresh" not in registry.names()
    handles = await asyncio.gather(*(registry.acquire("fresh") for _ in range(5)))
    assert len({h.int_id for h in handles}) == 1
    record = registry.get("fresh")
    assert (record.origin, record.loads) == ("folder", 1)
    assert "fresh" in registry.names()
    for handle in handles:
        registry.release(handle)


async def test_a_name_found_nowhere_is_not_found_and_the_switch_turns_it_off(
    folder: Path,
) -> None:
    registry, _ = registry_for(folder)
    with pytest.raises(AdapterNotFound):
        await registry.acquire("nowhere")
    off, _ = registry_for(folder, on_demand=False)
    assert "a1" not in off
    with pytest.raises(AdapterNotFound):
        await off.acquire("a1")


async def test_a_malformed_folder_is_refused_with_its_reason_until_its_files_change(
    folder: Path,
) -> None:
    registry, engine = registry_for(folder)
    write_adapter(folder / "big", rank=16)
    with pytest.raises(AdapterInvalid, match="rank 16"):
        await registry.acquire("big")
    assert "rank 16" in registry.failures()["big"].reason
    with pytest.raises(AdapterInvalid, match="rank 16"):
        await registry.acquire("big")  # refused again without touching the engine
    assert not engine.adapters
    shutil.rmtree(folder / "big")
    write_adapter(folder / "big", rank=8)
    handle = await registry.acquire("big")
    assert handle.int_id in engine.adapters
    registry.release(handle)


# ---- the folder kept in sync ----------------------------------------------------------------
async def test_a_rescan_adds_new_folders_removes_gone_ones_and_reloads_changed_ones(
    folder: Path,
) -> None:
    registry, engine = registry_for(folder)
    for name in ("a1", "a2"):
        await registry.register(name, str(folder / name), origin="folder")
    busy = await registry.acquire("a2")
    write_adapter(folder / "new")
    shutil.rmtree(folder / "a2")
    old_a1 = registry.get("a1").handle.int_id
    change_weights(folder / "a1")
    report = await registry.sync_folders()
    assert (report.added, report.removed, report.reloaded) == (("new",), ("a2",), ("a1",))
    assert set(registry.names()) == {"a1", "new"}
    assert registry.get("a1").handle.int_id != old_a1
    assert busy.int_id in engine.adapters, "a removed adapter's running request finishes first"
    registry.release(busy)
    await asyncio.sleep(0.05)
    assert busy.int_id not in engine.adapters


async def test_a_rescan_leaves_api_and_config_registrations_alone(folder: Path) -> None:
    registry, _ = registry_for(folder)
    await registry.register("by-api", str(folder / "a1"))
    await registry.register("by-config", str(folder / "a2"), origin="config")
    shutil.rmtree(folder / "a1")
    shutil.rmtree(folder / "a2")
    report = await registry.sync_folders()
    assert report.removed == ()
    assert {"by-api", "by-config"} <= set(registry.names())


# ---- the state file -------------------------------------------------------------------------
async def test_management_registrations_are_written_and_read_back(
    folder: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state" / "adapters.json"
    registry, _ = registry_for(folder, state=state)
    await registry.register("kept", str(folder / "a1"), pin=True)
    await registry.register("from-folder", str(folder / "a2"), origin="folder")
    assert read_state(state) == [SavedAdapter("kept", str(folder / "a1"), True, True, {})]
    await registry.update("kept", pin=False)
    assert read_state(state)[0].pin is False
    await registry.unregister("kept")
    assert read_state(state) == []


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{nope", "is not valid JSON"),
        ('{"version": 7, "adapters": []}', "is not a version 1 state"),
        ('{"version": 1}', "has no 'adapters' list"),
        ('{"version": 1, "adapters": [{"name": 5, "src": "x"}]}', "adapters[0] needs name"),
    ],
)
def test_a_damaged_state_file_names_itself_and_the_fix(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = tmp_path / "state.json"
    path.write_text(text)
    with pytest.raises(StateFileError) as caught:
        read_state(path)
    message = str(caught.value)
    assert str(path) in message and problem in message and "Fix:" in message


def test_a_missing_state_file_is_an_empty_state(tmp_path: Path) -> None:
    assert read_state(tmp_path / "state.json") == []


# ---- residency and load signals -------------------------------------------------------------
async def test_cold_loads_and_load_latency_are_exported_per_adapter(folder: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from server.core.admission import Admission, Limits
    from server.observability.metrics import AdapterCollector

    registry, _ = registry_for(folder)
    await registry.register("a1", str(folder / "a1"))  # preloaded: a load, not a cold one
    await registry.register("a2", str(folder / "a2"), preload=False)
    registry.release(await registry.acquire("a2"))  # a request waited for this load
    snapshots = {s.name: s for s in registry.snapshots()}
    assert (snapshots["a1"].loads, snapshots["a1"].cold_loads) == (1, 0)
    assert (snapshots["a2"].loads, snapshots["a2"].cold_loads) == (1, 1)
    prometheus = CollectorRegistry()
    prometheus.register(AdapterCollector(registry, Admission(Limits())))
    text = generate_latest(prometheus).decode()
    assert 'gateway_adapter_cold_loads_total{adapter="a2"} 1.0' in text
    assert 'gateway_adapter_load_seconds_count{adapter="a1"} 1.0' in text
    assert 'gateway_adapter_load_seconds_bucket{adapter="a2",le="+Inf"} 1.0' in text
