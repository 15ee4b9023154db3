"""AdapterRegistry and adapter file validation: the fake engine, adapters written to temp dirs."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest

from server.core.adapter_files import AdapterRules
from server.core.adapter_residency import SETTLE_STEPS
from server.core.adapters import AdapterLimits, AdapterRegistry, Residency
from server.core.errors import (
    AdapterCapacity,
    AdapterExists,
    AdapterInvalid,
    AdapterNotFound,
    InvalidRequest,
    LoraDisabled,
    Overloaded,
)
from server.core.types import AdapterHandle, GenerationRequest, Sampling, TextPrompt
from server.engines.fake import FakeEngine, FakeScript
from tests.unit.demo_kit import SHAPE, write_adapter

pytestmark = pytest.mark.anyio

@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "adapters"
    for name in ("a1", "a2", "a3", "a4", "a5"):
        write_adapter(folder / name)
    return folder


def make_registry(
    root: Path, engine: FakeEngine | None = None, *, max_loras: int = 2, max_cpu_loras: int = 4,
    wait_s: float = 5.0, enabled: bool = True, settle_s: float = 0.0,
) -> tuple[AdapterRegistry, FakeEngine]:
    engine = engine or FakeEngine(model_name="tiny")
    rules = AdapterRules(roots=(str(root),), max_rank=8, base_names=frozenset({"tiny"}),
                         base_shape=SHAPE)
    limits = AdapterLimits(enabled=enabled, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                           wait_s=wait_s, settle_s=settle_s)
    return AdapterRegistry(engine=engine, rules=rules, limits=limits), engine


def names_in_engine(engine: FakeEngine) -> set[str]:
    return {handle.name for handle in engine.adapters.values()}


# ---- validation: each bad adapter kind is refused before the engine sees it ------------------

def bad_sources(root: Path, tmp_path: Path) -> dict[str, str]:
    outside = write_adapter(tmp_path / "outside" / "x")
    (root / "escape").symlink_to(outside)
    weights_link = write_adapter(root / "weights_link")
    (weights_link / "adapter_model.safetensors").unlink()
    (weights_link / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    write_adapter(root / "big16", rank=16)
    write_adapter(root / "noconfig").joinpath("adapter_config.json").unlink()
    corrupt = write_adapter(root / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    truncated = write_adapter(root / "truncated")
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[:-8])
    pickle_only = write_adapter(root / "pickle_only")
    (pickle_only / "adapter_model.safetensors").rename(pickle_only / "adapter_model.bin")
    write_adapter(root / "dora", config={"use_dora": True})
    write_adapter(root / "embed", config={"target_modules": ["embed_tokens"]})
    write_adapter(root / "alpha_text", config={"lora_alpha": "16"})
    write_adapter(root / "alpha_nan", config={"lora_alpha": float("nan")})
    write_adapter(root / "alpha_huge", config={"lora_alpha": 10**400})
    write_adapter(root / "alpha_pattern", config={"alpha_pattern": {"q_proj": "x"}})
    write_adapter(root / "deep", layers=3)
    write_adapter(root / "hidden_rank", tensor_rank=16)
    fifo = write_adapter(root / "fifo")
    (fifo / "adapter_model.safetensors").unlink()
    os.mkfifo(fifo / "adapter_model.safetensors")
    return {
        "rank too high": str(root / "big16"),
        "tensor rank too high": str(root / "hidden_rank"),
        "missing dir": str(root / "nope"),
        "no config": str(root / "noconfig"),
        "corrupt weights": str(root / "corrupt"),
        "truncated weights": str(root / "truncated"),
        "pickle only": str(root / "pickle_only"),
        "outside root": str(outside),
        "dot dot": f"{root}/a1/../a2",
        "symlink escape": str(root / "escape"),
        "weights symlink escape": str(root / "weights_link"),
        "proc": "/proc/self",
        "proc cwd": "/proc/self/cwd",
        "device": "/dev/null",
        "fifo weights": str(root / "fifo"),
        "dora": str(root / "dora"),
        "unsupported module": str(root / "embed"),
        "alpha not a number": str(root / "alpha_text"),
        "alpha NaN": str(root / "alpha_nan"),
        "alpha beyond a float": str(root / "alpha_huge"),
        "alpha pattern not a number": str(root / "alpha_pattern"),
        "more layers than the base": str(root / "deep"),
        "empty": "",
        "not a string": 42,  # type: ignore[dict-item]
    }


@pytest.mark.parametrize(
    "kind",
    ["rank too high", "tensor rank too high", "missing dir", "no config", "corrupt weights",
     "truncated weights", "pickle only", "outside root", "dot dot", "symlink escape",
     "weights symlink escape", "proc", "proc cwd", "device", "fifo weights", "dora",
     "unsupported module", "more layers than the base", "empty", "not a string",
     "alpha not a number", "alpha NaN", "alpha beyond a float", "alpha pattern not a number"],
)
async def test_bad_adapter_is_refused_before_the_engine_sees_it(
    root: Path, tmp_path: Path, kind: str
) -> None:
    registry, engine = make_registry(root)
    src = bad_sources(root, tmp_path)[kind]
    with pytest.raises(InvalidRequest) as caught:
        await registry.register("bad", src)
    assert caught.value.message
    assert "bad" not in registry
    assert engine.adapters == {}


@pytest.mark.parametrize(
    ("kind", "words"),
    [("rank too high", "greater than max_lora_rank 8"), ("pickle only", "pickle"),
     ("corrupt weights", "corrupt"), ("no config", "adapter_config.json"),
     ("outside root", "outside the allowed adapter roots"), ("dot dot", "'..'"),
     ("symlink escape", "outside the allowed"), ("proc", "system tree"),
     ("missing dir", "not a directory"), ("weights symlink escape", "outside the adapter roots"),
     ("alpha NaN", "'lora_alpha' must be a finite number")],
)
async def test_refusal_message_names_the_problem(
    root: Path, tmp_path: Path, kind: str, words: str
) -> None:
    registry, _ = make_registry(root)
    with pytest.raises(InvalidRequest, match=words):
        await registry.register("bad", bad_sources(root, tmp_path)[kind])


@pytest.mark.parametrize("name", ["", "has space", "a/b", "../x", ".hidden", "x" * 257, "tiny", 5])
async def test_invalid_or_reserved_names_are_refused(root: Path, name: object) -> None:
    registry, engine = make_registry(root)
    with pytest.raises(InvalidRequest):
        await registry.register(name, str(root / "a1"))
    assert engine.adapters == {}


async def test_engine_refusal_is_a_4xx_and_forgets_the_adapter(root: Path) -> None:
    engine = FakeEngine(FakeScript(bad_adapter_paths={str(root / "a1")}))
    registry, _ = make_registry(root, engine)
    with pytest.raises(AdapterInvalid):
        await registry.register("a1", str(root / "a1"))
    assert "a1" not in registry


async def test_disabled_lora_refuses_registration(root: Path) -> None:
    registry, _ = make_registry(root, enabled=False)
    with pytest.raises(LoraDisabled, match=r"LoRA is not enabled\."):
        await registry.register("a1", str(root / "a1"))


# ---- registration, ids, preload --------------------------------------------------------------

async def test_preloaded_adapter_is_in_the_engine_and_lazy_one_loads_on_first_use(
    root: Path,
) -> None:
    registry, engine = make_registry(root)
    await registry.register("a1", str(root / "a1"))
    await registry.register("a2", str(root / "a2"), preload=False)
    assert names_in_engine(engine) == {"a1"}
    assert registry.get("a2").residency is Residency.REGISTERED
    handle = await registry.acquire("a2")
    assert names_in_engine(engine) == {"a1", "a2"}
    assert registry.get("a2").residency is Residency.ENGINE_SLOT
    registry.release(handle, generated_tokens=5)
    record = registry.get("a2")
    assert (record.residency, record.requests, record.generated_tokens, record.loads) == (
        Residency.CPU_CACHE, 1, 5, 1)


async def test_duplicate_name_is_refused(root: Path) -> None:
    registry, _ = make_registry(root)
    await registry.register("a1", str(root / "a1"))
    with pytest.raises(AdapterExists, match="already exists"):
        await registry.register("a1", str(root / "a2"))


async def test_reregistering_the_same_adapter_keeps_its_integer_id(root: Path) -> None:
    registry, _ = make_registry(root)
    first = (await registry.register("a1", str(root / "a1"))).handle.int_id
    other = (await registry.register("a2", str(root / "a2"))).handle.int_id
    await registry.unregister("a1")
    again = (await registry.register("a1", str(root / "a1"))).handle.int_id
    assert first == again != other


async def test_unknown_adapter_is_not_found(root: Path) -> None:
    registry, _ = make_registry(root)
    with pytest.raises(AdapterNotFound):
        await registry.acquire("nope")
    with pytest.raises(AdapterNotFound, match="The adapter nope was not found"):
        await registry.unregister("nope")


# ---- capacity, LRU, pins -------------------------------------------------------------------

async def use(registry: AdapterRegistry, name: str) -> None:
    registry.release(await registry.acquire(name))


async def test_least_recently_used_idle_adapter_is_evicted_and_reloaded(root: Path) -> None:
    registry, engine = make_registry(root, max_cpu_loras=2)
    for name in ("a1", "a2", "a3"):
        await registry.register(name, str(root / name), preload=False)
    await use(registry, "a1")
    await use(registry, "a2")
    await use(registry, "a1")
    await use(registry, "a3")  # evicts a2, the least recently used
    assert names_in_engine(engine) == {"a1", "a3"}
    await use(registry, "a2")  # evicts a1
    assert names_in_engine(engine) == {"a2", "a3"}
    a2 = registry.get("a2")
    assert (a2.loads, a2.evictions) == (2, 1)


async def test_a_request_during_an_eviction_waits_and_loads_the_adapter_again(
    root: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine never gets a request for an adapter it is being asked to remove (it would read
    the adapter back inside a step, evicting whatever its own LRU picks)."""
    registry, engine = make_registry(root, max_cpu_loras=2)
    for name in ("a1", "a2", "a3"):
        await registry.register(name, str(root / name), preload=False)
    await use(registry, "a1")
    await use(registry, "a2")
    removing, done = asyncio.Event(), asyncio.Event()
    remove = engine.remove_adapter

    async def slow_remove(handle: AdapterHandle) -> None:
        removing.set()
        await done.wait()
        await remove(handle)

    monkeypatch.setattr(engine, "remove_adapter", slow_remove)
    cold = asyncio.create_task(registry.acquire("a3"))  # evicts a1, the least recently used
    await removing.wait()
    again = asyncio.create_task(registry.acquire("a1"))
    await asyncio.sleep(0.01)
    assert not again.done()  # not handed out while the engine removes it
    done.set()
    registry.release(await cold)
    registry.release(await again)
    assert "a1" in names_in_engine(engine) and registry.get("a1").loads == 2


async def test_pinned_adapter_is_never_evicted(root: Path) -> None:
    registry, engine = make_registry(root, max_loras=2, max_cpu_loras=3)
    await registry.register("a1", str(root / "a1"), pin=True)
    for name in ("a2", "a3", "a4", "a5", "a2", "a4"):
        if name not in registry:
            await registry.register(name, str(root / name), preload=False)
        await use(registry, name)
        assert "a1" in names_in_engine(engine)
        assert len(engine.adapters) <= 3
    assert registry.get("a1").evictions == 0


async def test_a_prefetch_loads_ahead_never_evicting_another_one_loaded_ahead(root: Path) -> None:
    registry, engine = make_registry(root, max_loras=1, max_cpu_loras=2)
    for name in ("a1", "a2", "a3", "a4", "a5"):
        await registry.register(name, str(root / name), preload=False)
    await use(registry, "a1")
    assert await registry.prefetch("a2")
    assert await registry.prefetch("a3")  # evicts a1, idle and not loaded ahead
    assert not await registry.prefetch("a4")  # a2 and a3 wait for their requests: no room
    assert names_in_engine(engine) == {"a2", "a3"} and await registry.prefetch("a2")
    await use(registry, "a4")  # a request's own load may take a place loaded ahead
    assert "a4" in names_in_engine(engine)
    assert [registry.get(n).prefetches for n in ("a2", "a3", "a4")] == [1, 1, 0]
    assert registry.get("a2").cold_loads == 0
    with pytest.raises(AdapterNotFound):
        await registry.prefetch("nope")


async def test_more_pins_than_slots_is_refused_with_no_free_slots(root: Path) -> None:
    registry, _ = make_registry(root, max_loras=2, max_cpu_loras=4)
    await registry.register("a1", str(root / "a1"), pin=True)
    await registry.register("a2", str(root / "a2"), pin=True)
    with pytest.raises(AdapterCapacity, match="No free lora slots"):
        await registry.register("a3", str(root / "a3"), pin=True)
    assert "a3" not in registry
    await registry.register("a4", str(root / "a4"))
    with pytest.raises(AdapterCapacity, match="No free lora slots"):
        await registry.update("a4", pin=True)
    assert not registry.get("a4").pin


async def test_pin_without_preload_is_refused(root: Path) -> None:
    registry, _ = make_registry(root)
    with pytest.raises(InvalidRequest, match="Can not set preload to false and pin to true"):
        await registry.register("a1", str(root / "a1"), preload=False, pin=True)


async def test_request_waits_for_a_busy_cache_place_then_runs(root: Path) -> None:
    registry, engine = make_registry(root, max_loras=1, max_cpu_loras=2)
    for name in ("a1", "a2", "a3"):
        await registry.register(name, str(root / name), preload=False)
    h1, h2 = await registry.acquire("a1"), await registry.acquire("a2")
    waiting = asyncio.create_task(registry.acquire("a3"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    registry.release(h1)
    h3 = await asyncio.wait_for(waiting, 2)
    assert names_in_engine(engine) == {"a2", "a3"}
    registry.release(h2)
    registry.release(h3)


async def test_request_gives_up_when_no_place_frees_in_time(root: Path) -> None:
    registry, _ = make_registry(root, max_loras=1, max_cpu_loras=2, wait_s=0.05)
    for name in ("a1", "a2", "a3"):
        await registry.register(name, str(root / name), preload=False)
    await registry.acquire("a1")
    await registry.acquire("a2")
    with pytest.raises(Overloaded, match="No free LoRA slot"):
        await registry.acquire("a3")


# ---- unregister and update -------------------------------------------------------------------

async def test_unregister_removes_the_adapter_from_the_engine(root: Path) -> None:
    registry, engine = make_registry(root)
    await registry.register("a1", str(root / "a1"))
    await registry.unregister("a1")
    assert engine.adapters == {}
    assert "a1" not in registry


async def test_unregister_with_requests_in_flight_lets_them_finish(root: Path) -> None:
    registry, engine = make_registry(root)
    await registry.register("a1", str(root / "a1"))
    handle = await registry.acquire("a1")
    await registry.unregister("a1")
    assert "a1" not in registry
    assert names_in_engine(engine) == {"a1"}  # still serving the running request
    registry.release(handle)
    await asyncio.sleep(0.01)
    assert engine.adapters == {}


async def test_update_with_a_new_source_swaps_adapters(root: Path) -> None:
    registry, engine = make_registry(root)
    old = await registry.register("a1", str(root / "a1"))
    new = await registry.update("a1", src=str(root / "a2"))
    await asyncio.sleep(0.01)
    assert new.handle.int_id != old.handle.int_id
    assert registry.get("a1").src == str(root / "a2")
    assert set(engine.adapters) == {new.handle.int_id}


async def test_failed_update_leaves_the_adapter_unchanged(root: Path, tmp_path: Path) -> None:
    registry, _ = make_registry(root)
    await registry.register("a1", str(root / "a1"), options={"k": "v"})
    with pytest.raises(AdapterInvalid):
        await registry.update("a1", src=str(tmp_path), pin=True)
    record = registry.get("a1")
    assert (record.src, record.pin, record.options) == (str(root / "a1"), False, {"k": "v"})


async def test_update_pins_and_unpins_in_place(root: Path) -> None:
    registry, _ = make_registry(root)
    record = await registry.register("a1", str(root / "a1"), preload=False)
    assert (await registry.update("a1", pin=True)) is record
    assert record.pin and record.resident
    await registry.update("a1", pin=False, options={"x": "1"})
    assert not record.pin and record.options == {"x": "1"}


# ---- aliases (DJL workflows) and snapshots ----------------------------------------------------

async def test_alias_selects_its_adapter(root: Path) -> None:
    registry, _ = make_registry(root)
    await registry.register("a1", str(root / "a1"))
    await registry.add_alias("wf", "a1")
    assert "wf" in registry
    assert (await registry.acquire("wf")).name == "a1"
    with pytest.raises(AdapterExists):
        await registry.add_alias("a1", "a1")
    with pytest.raises(AdapterExists):
        await registry.register("wf", str(root / "a2"))


async def test_snapshots_report_counters_and_residency(root: Path) -> None:
    registry, _ = make_registry(root)
    await registry.register("a1", str(root / "a1"), pin=True)
    await registry.register("a2", str(root / "a2"), preload=False)
    registry.release(await registry.acquire("a1"), generated_tokens=3)
    snaps = {s.name: s for s in registry.snapshots()}
    assert snaps["a1"].pinned and snaps["a1"].requests == 1 and snaps["a1"].generated_tokens == 3
    assert snaps["a1"].residency is Residency.CPU_CACHE
    assert snaps["a2"].residency is Residency.REGISTERED
    assert await registry.engine_resident() == {"a1"}


# ---- concurrency ---------------------------------------------------------------------------------

async def test_concurrent_register_unregister_and_traffic_keep_state_consistent(
    root: Path,
) -> None:
    registry, engine = make_registry(root, max_loras=2, max_cpu_loras=3, wait_s=10)
    names = ["a1", "a2", "a3", "a4", "a5"]
    rng = random.Random(7)
    served = 0
    for name in names[:3]:
        await registry.register(name, str(root / name))

    async def traffic() -> None:
        nonlocal served
        for _ in range(60):
            name = rng.choice(names)
            try:
                handle = await registry.acquire(name)
            except AdapterNotFound:
                await asyncio.sleep(0.001)
                continue
            assert handle.int_id in engine.adapters
            await asyncio.sleep(rng.random() / 500)
            registry.release(handle, 1)
            served += 1

    async def churn() -> None:
        for _ in range(40):
            name = rng.choice(names)
            try:
                if name in registry:
                    await registry.unregister(name)
                else:
                    await registry.register(name, str(root / name), preload=rng.random() < 0.5)
            except (AdapterExists, AdapterNotFound):
                pass
            await asyncio.sleep(0)

    await asyncio.gather(*(traffic() for _ in range(6)), churn(), churn())
    await asyncio.sleep(0.05)
    resident = {r.handle.int_id for r in registry.records() if r.resident}
    assert served > 0
    assert set(engine.adapters) == resident
    assert len(engine.adapters) <= 3
    assert all(r.inflight == 0 for r in registry.records())


async def test_metrics_collector_exports_registered_adapters_only(root: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from server.core.admission import Admission, Limits
    from server.observability.metrics import AdapterCollector

    registry, _ = make_registry(root)
    await registry.register("a1", str(root / "a1"))
    registry.release(await registry.acquire("a1"), generated_tokens=4)
    with pytest.raises(AdapterNotFound):
        await registry.acquire("unknown")
    prom = CollectorRegistry()
    prom.register(AdapterCollector(registry, Admission(Limits())))
    text = generate_latest(prom).decode()
    assert 'gateway_adapter_requests_total{adapter="a1"} 1.0' in text
    assert 'gateway_adapter_generation_tokens_total{adapter="a1"} 4.0' in text
    assert 'gateway_adapter_loads_total{adapter="a1"} 1.0' in text
    assert 'gateway_adapter_residency{adapter="a1",residency="cpu_cache"} 1.0' in text
    assert 'gateway_adapter_requests_queued{adapter="a1"} 0.0' in text
    assert "unknown" not in text


async def test_an_adapter_stays_in_the_engine_until_it_settled(root: Path) -> None:
    """vLLM may still run a finished request's adapter in a step it already scheduled: nothing
    leaves the engine until `settle_s` after its last request, neither evicted nor unloaded."""
    registry, engine = make_registry(root, max_loras=1, max_cpu_loras=2, settle_s=0.2)
    for name in ("a1", "a2"):
        await registry.register(name, str(root / name))
    await registry.register("a3", str(root / "a3"), preload=False)
    registry.release(await registry.acquire("a1"))  # a1 is now the least recently used
    registry.release(await registry.acquire("a2"))
    started = asyncio.get_running_loop().time()
    handle = await registry.acquire("a3")  # needs a place: waits for a1 to settle
    assert asyncio.get_running_loop().time() - started >= 0.15
    assert names_in_engine(engine) == {"a2", "a3"}
    registry.release(handle)
    await registry.unregister("a3")  # answers once a3 settled and left the engine
    assert names_in_engine(engine) == {"a2"}


async def settling_registry(root: Path, *, wait_s: float = 5.0) -> tuple[AdapterRegistry,
                                                                       FakeEngine]:
    """Two cached places, a1 then a2 used and idle, a3 registered only; settle_s far beyond
    the test, so only engine steps can settle anything."""
    registry, engine = make_registry(root, max_loras=1, max_cpu_loras=2, settle_s=600.0,
                                     wait_s=wait_s)
    for name in ("a1", "a2"):
        await registry.register(name, str(root / name))
    await registry.register("a3", str(root / "a3"), preload=False)
    await use(registry, "a1")
    await use(registry, "a2")
    return registry, engine


async def test_two_engine_steps_settle_an_adapter_before_settle_s(root: Path) -> None:
    """Steps the engine completed after a request ended prove no step still runs its adapter:
    a place frees without waiting for `settle_s`."""
    registry, engine = await settling_registry(root)
    engine.step_count += 2
    registry.release(await registry.acquire("a3"))  # settle_s (600 s) > wait_s: steps did it
    assert names_in_engine(engine) == {"a2", "a3"}
    assert registry.get("a1").evictions == 1


async def test_one_engine_step_does_not_settle_an_adapter(root: Path) -> None:
    """The step that ended the request may not be counted yet when it ends: one is not enough."""
    registry, engine = await settling_registry(root, wait_s=0.1)
    engine.step_count += 1
    with pytest.raises(Overloaded):
        await registry.acquire("a3")
    assert names_in_engine(engine) == {"a1", "a2"}


async def test_steps_never_settle_an_adapter_with_requests_in_flight(root: Path) -> None:
    registry, engine = await settling_registry(root, wait_s=0.1)
    held = [await registry.acquire("a1"), await registry.acquire("a2")]
    engine.step_count += 10
    with pytest.raises(Overloaded):
        await registry.acquire("a3")
    assert names_in_engine(engine) == {"a1", "a2"}
    for handle in held:
        registry.release(handle)


async def test_a_waiting_request_sees_the_steps_that_settle_a_place(root: Path) -> None:
    """The engine does not signal its steps: a request waiting for a place looks again soon."""
    registry, engine = await settling_registry(root)
    waiting = asyncio.create_task(registry.acquire("a3"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    engine.step_count += 2
    registry.release(await asyncio.wait_for(waiting, 2))
    assert names_in_engine(engine) == {"a2", "a3"}


async def test_a_retired_adapter_leaves_the_engine_once_steps_settled_it(root: Path) -> None:
    registry, engine = await settling_registry(root)
    unregistering = asyncio.create_task(registry.unregister("a2"))
    await asyncio.sleep(0.05)
    assert not unregistering.done()
    assert "a2" in names_in_engine(engine)
    engine.step_count += 2
    await asyncio.wait_for(unregistering, 2)
    assert names_in_engine(engine) == {"a1"}


async def test_an_engine_copy_two_names_share_settles_after_both(root: Path) -> None:
    """Two names for the same files share the engine's copy: it stays until the last request
    on either of them settled."""
    registry, engine = await settling_registry(root, wait_s=0.1)
    await registry.register("twin", str(root / "a1"))
    assert registry.get("twin").handle.int_id == registry.get("a1").handle.int_id
    engine.step_count += 2  # a1 settled
    await use(registry, "twin")  # the copy a1 shares ran just now
    await use(registry, "a2")
    with pytest.raises(Overloaded):
        await registry.acquire("a3")  # a1 alone settled long ago, its engine copy did not
    assert registry.get("a1").evictions == 0 and len(engine.adapters) == 2
    engine.step_count += 2
    registry.release(await registry.acquire("a3"))


async def test_generation_on_the_fake_engine_counts_steps(root: Path) -> None:
    """The fake engine's steps advance with its requests, as a real engine's do."""
    engine = FakeEngine(model_name="tiny")
    before = engine.steps()
    request = GenerationRequest(request_id="r1", model="", prompt=TextPrompt("w1 w2"),
                                sampling=Sampling(max_new_tokens=2))
    events = [event async for event in engine.generate(request, "r1", None)]
    assert events
    assert engine.steps() >= before + SETTLE_STEPS

