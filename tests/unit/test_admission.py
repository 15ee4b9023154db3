"""Admission on its own: the bounded queue, its order across adapters (round-robin or one FIFO),
timeouts, cancellation and batches."""

from __future__ import annotations

import asyncio
import random

import pytest

from server.core.admission import Admission, Limits
from server.core.errors import Overloaded

pytestmark = pytest.mark.anyio


class Watcher:
    """Records what admission reports."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.queues: list[tuple[str, int, int]] = []  # key, its slots, all waiting
        self.waits: list[tuple[str, float]] = []
        self.rotations: list[str] = []

    def queue_changed(self, key: str, slots: int) -> None:
        self.queues.append((key, slots, self._admission.waiting))

    def adapter_waited(self, key: str, seconds: float) -> None:
        self.waits.append((key, seconds))

    def adapter_rotated(self, key: str) -> None:
        self.rotations.append(key)


async def grant_order(limits: Limits, waiters: list[tuple[str, str]]) -> list[str]:
    """Hold every slot, queue `waiters` ((name, key), in this order), then free the slots and
    return the names in the order they were granted (each gives its slot back at once)."""
    admission = Admission(limits)
    await admission.acquire(limits.max_concurrent)
    order: list[str] = []

    async def wait(name: str, key: str) -> None:
        await admission.acquire(1, key)
        order.append(name)
        admission.release()

    tasks = []
    for name, key in waiters:
        tasks.append(asyncio.create_task(wait(name, key)))
        await asyncio.sleep(0)  # queued in this order
    admission.release(limits.max_concurrent)
    await asyncio.gather(*tasks)
    assert (admission.running, admission.waiting, admission.queued()) == (0, 0, {})
    return order


HOT_THEN_COLD = [(f"h{i}", "hot") for i in range(6)] + [("c1", "cold1"), ("c2", "cold2")]


@pytest.mark.parametrize(
    ("fair", "expected"),
    [
        (True, ["h0", "c1", "c2", "h1", "h2", "h3", "h4", "h5"]),
        (False, ["h0", "h1", "h2", "h3", "h4", "h5", "c1", "c2"]),
    ],
)
async def test_a_skewed_queue_serves_cold_adapters_after_one_hot_grant_only_when_fair(
    fair: bool, expected: list[str]
) -> None:
    assert await grant_order(Limits(max_concurrent=1, fair=fair), HOT_THEN_COLD) == expected


async def test_adapters_with_waiters_take_turns_in_order_of_first_arrival() -> None:
    waiters = [("a0", "a"), ("a1", "a"), ("a2", "a"), ("b0", "b"), ("c0", "c"), ("b1", "b")]
    order = await grant_order(Limits(max_concurrent=1), waiters)
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2"]


@pytest.mark.parametrize("fair", [True, False])
async def test_a_single_adapter_stays_fifo(fair: bool) -> None:
    waiters = [(f"r{i}", "a1") for i in range(8)]
    order = await grant_order(Limits(max_concurrent=2, fair=fair), waiters)
    assert order == [f"r{i}" for i in range(8)]


async def test_a_batch_at_the_head_of_its_turn_is_not_overtaken() -> None:
    """Two slots; the batch (2) has the turn and waits for both, the single request behind it
    in the other adapter's queue does not slip into the one free slot."""
    admission = Admission(Limits(max_concurrent=2))
    await admission.acquire(1, "x")
    batch = asyncio.create_task(admission.acquire(2, "a"))
    await asyncio.sleep(0)
    single = asyncio.create_task(admission.acquire(1, "b"))
    await asyncio.sleep(0.01)
    assert not batch.done() and not single.done()
    assert admission.queued() == {"a": 2, "b": 1}
    admission.release(1)
    await batch
    assert admission.running == 2 and not single.done()
    admission.release(2)
    await single
    admission.release(1)
    assert (admission.running, admission.waiting) == (0, 0)


async def test_try_acquire_takes_free_slots_and_never_queues_or_overtakes() -> None:
    admission = Admission(Limits(max_concurrent=2))
    assert admission.try_acquire(1, "a") and admission.try_acquire(1, "b")
    assert not admission.try_acquire(1, "a")  # full: the request goes to `acquire`
    assert (admission.running, admission.waiting, admission.queued()) == (2, 0, {})
    waiter = asyncio.create_task(admission.acquire(1, "c"))
    await asyncio.sleep(0)
    admission.release(1, "a")
    await waiter  # the waiter got the freed slot, not a later try_acquire
    admission.release(1, "b")
    batch = asyncio.create_task(admission.acquire(2, "d"))  # one slot free: the batch waits
    await asyncio.sleep(0)
    assert not admission.try_acquire(1, "e")  # the waiting batch's turn is not overtaken
    admission.release(1, "c")
    await batch
    assert (admission.running, admission.waiting) == (2, 0)


async def test_the_queue_bound_counts_every_adapter() -> None:
    admission = Admission(Limits(max_concurrent=1, max_queue=3))
    await admission.acquire()
    waiters = [asyncio.create_task(admission.acquire(1, key)) for key in ("a", "a", "b")]
    await asyncio.sleep(0)
    assert admission.waiting == 3 and admission.saturated
    with pytest.raises(Overloaded):
        await admission.acquire(1, "c")  # a new adapter gets no queue of its own beyond the bound
    with pytest.raises(Overloaded):
        await admission.acquire(1, "a")
    assert admission.queued() == {"a": 2, "b": 1}
    for _ in waiters:
        admission.release()
        await asyncio.sleep(0)
    await asyncio.gather(*waiters)
    admission.release()


async def test_a_waiter_that_times_out_leaves_its_adapter_queue() -> None:
    admission = Admission(Limits(max_concurrent=1, queue_timeout_s=0.05))
    await admission.acquire(1, "hot")
    with pytest.raises(Overloaded, match="timed out waiting in the queue"):
        await admission.acquire(1, "cold")
    assert (admission.waiting, admission.queued()) == (0, {})
    later = asyncio.create_task(admission.acquire(1, "hot"))
    await asyncio.sleep(0)
    admission.release()
    await later
    assert admission.running == 1


async def test_a_cancelled_waiter_gives_up_its_turn_and_its_place() -> None:
    admission = Admission(Limits(max_concurrent=1))
    await admission.acquire()
    order: list[str] = []

    async def wait(name: str, key: str) -> None:
        await admission.acquire(1, key)
        order.append(name)
        admission.release()

    hot = [asyncio.create_task(wait(f"h{i}", "hot")) for i in range(2)]
    await asyncio.sleep(0)
    cold = asyncio.create_task(wait("c", "cold"))
    await asyncio.sleep(0)
    assert admission.queued() == {"hot": 2, "cold": 1}
    cold.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cold
    assert (admission.waiting, admission.queued()) == (2, {"hot": 2})
    admission.release()
    await asyncio.gather(*hot)
    assert order == ["h0", "h1"]
    assert (admission.running, admission.waiting) == (0, 0)



async def test_a_watcher_sees_every_queue_change_with_the_slots_it_asks_for() -> None:
    """Queued (a batch of 2 counts 2), granted, cancelled: each change reported once, after
    `waiting` moved."""
    admission = Admission(Limits(max_concurrent=1))
    watcher = Watcher(admission)
    seen = watcher.queues
    admission.watch(watcher)
    await admission.acquire()  # no queue: nothing to report
    first = asyncio.create_task(admission.acquire(2, "a"))
    await asyncio.sleep(0)
    second = asyncio.create_task(admission.acquire(1, "b"))
    await asyncio.sleep(0)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    admission.release()
    await first
    assert seen == [("a", 2, 2), ("b", 1, 3), ("b", 0, 2), ("a", 0, 0)]


# ---- adapter slots ---------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def slotted(slots: int = 2, cycle_s: float = 1.0, **more: int) -> tuple[Admission, Clock]:
    clock = Clock()
    limits = Limits(max_concurrent=64, adapter_slots=slots, cycle_s=cycle_s, **more)
    return Admission(limits, clock=clock), clock


async def started(admission: Admission, key: str) -> asyncio.Task[None]:
    """A request on `key`, queued or admitted before this returns."""
    task = asyncio.create_task(admission.acquire(1, key))
    await asyncio.sleep(0)
    return task


@pytest.mark.parametrize("fair", [True, False])
async def test_adapter_slots_are_never_exceeded_and_every_adapter_is_served(fair: bool) -> None:
    clock = Clock()
    admission = Admission(
        Limits(max_concurrent=8, adapter_slots=2, cycle_s=0.5, fair=fair), clock=clock
    )
    in_flight: dict[str, int] = {}
    most = 0

    async def request(key: str) -> None:
        nonlocal most
        await admission.acquire(1, key)
        in_flight[key] = in_flight.get(key, 0) + 1
        most = max(most, sum(1 for k, n in in_flight.items() if n and k))
        for _ in range(3):  # runs a few steps while the clock moves
            clock.now += 0.1
            await asyncio.sleep(0)
        in_flight[key] -= 1
        admission.release(1, key)

    keys = [f"a{i % 7}" for i in range(70)] + [""] * 20
    random.Random(7).shuffle(keys)
    await asyncio.wait_for(asyncio.gather(*(request(k) for k in keys)), 10)
    assert most == 2
    assert (admission.running, admission.waiting, admission.active_adapters()) == (0, 0, [])


async def test_few_adapters_and_the_base_model_never_wait_for_an_adapter_slot() -> None:
    admission, _ = slotted(slots=2)
    for key in ("a", "b", "a", "", "", "b"):
        await asyncio.wait_for(admission.acquire(1, key), 1)
    waiting = await started(admission, "c")
    assert admission.queued() == {"c": 1}
    await asyncio.wait_for(admission.acquire(1, ""), 1)  # the base model passes a full set
    assert admission.active_adapters() == ["a", "b"]
    waiting.cancel()


async def test_an_adapter_past_its_cycle_drains_and_hands_its_slot_to_a_waiting_one() -> None:
    admission, clock = slotted(slots=2, cycle_s=1.0)
    watcher = Watcher(admission)
    admission.watch(watcher)
    await admission.acquire(1, "hot")
    await admission.acquire(1, "b")
    cold = await started(admission, "cold")  # no slot: both are held
    await asyncio.wait_for(admission.acquire(1, "hot"), 1)  # within its cycle: admitted
    clock.now = 1.5
    late_hot = await started(admission, "hot")  # past its cycle while "cold" waits: queued
    assert admission.queued() == {"cold": 1, "hot": 1}
    admission.release(1, "hot")
    assert not cold.done()  # "hot" still runs one
    admission.release(1, "hot")
    await asyncio.wait_for(cold, 1)
    assert admission.active_adapters() == ["b", "cold"]
    assert not late_hot.done()  # now "hot" waits for a slot like any other adapter
    admission.release(1, "b")
    await asyncio.wait_for(late_hot, 1)
    assert watcher.rotations == ["cold", "hot"]
    assert [key for key, _ in watcher.waits] == ["hot", "b", "hot", "cold", "hot"]
    assert [seconds for _, seconds in watcher.waits][-2:] == [1.5, 0.0]


async def test_waiting_adapters_are_loaded_ahead_once_and_asked_again_when_there_was_no_room(
) -> None:
    answers = [False, True, True]
    asked: list[str] = []

    async def prefetch(key: str) -> bool:
        asked.append(key)
        return answers.pop(0)

    admission = Admission(Limits(max_concurrent=64, adapter_slots=2, prefetch=1), prefetch)
    await admission.acquire(1, "a")
    await admission.acquire(1, "b")
    waiters = [await started(admission, "c")]
    await asyncio.sleep(0)
    assert asked == ["c"]  # no room yet
    waiters.append(await started(admission, "d"))
    await asyncio.sleep(0)
    assert asked == ["c", "c"]  # asked again at the next change, only the next one in turn
    waiters.append(await started(admission, "c"))
    await asyncio.sleep(0)
    assert asked == ["c", "c"]
    admission.release(1, "a")  # "c" takes the slot; "d" is next
    await asyncio.sleep(0)
    assert asked == ["c", "c", "d"]
    for waiter in waiters:
        waiter.cancel()


async def test_a_cancelled_waiter_gives_back_the_adapter_slot_it_was_holding_out_for() -> None:
    admission, _ = slotted(slots=1)
    await admission.acquire(1, "a")
    queued = await started(admission, "b")
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    admission.release(1, "a")
    assert admission.active_adapters() == []
    await asyncio.wait_for(admission.acquire(1, "c"), 1)
    assert admission.active_adapters() == ["c"]


async def test_a_free_slot_goes_to_an_adapter_that_waited_a_cycle_else_to_the_most_waiting(
) -> None:
    admission, clock = slotted(slots=1, cycle_s=1.0)
    await admission.acquire(1, "a")
    first = [await started(admission, "b")]
    clock.now = 0.5
    crowd = [await started(admission, "c") for _ in range(3)]
    admission.release(1, "a")  # nobody waited a cycle: "c" has the most waiting
    await asyncio.wait_for(asyncio.gather(*crowd), 1)
    assert admission.active_adapters() == ["c"] and not first[0].done()
    clock.now = 1.2
    later = [await started(admission, "d") for _ in range(3)]
    admission.release(3, "c")  # "b" waited 1.2 s, past the cycle: it goes before the crowd
    await asyncio.wait_for(first[0], 1)
    assert admission.active_adapters() == ["b"] and not any(t.done() for t in later)
    admission.release(1, "b")
    await asyncio.wait_for(asyncio.gather(*later), 1)


async def test_an_adapter_the_engine_holds_passes_full_slots_until_another_waited_a_cycle(
) -> None:
    clock = Clock()
    admission = Admission(Limits(max_concurrent=64, adapter_slots=1, cycle_s=1.0), clock=clock,
                          resident=lambda key: key == "held")
    await admission.acquire(1, "a")
    await asyncio.wait_for(admission.acquire(1, "held"), 1)  # loaded in the engine: no place taken
    cold = await started(admission, "cold")
    await asyncio.wait_for(admission.acquire(1, "held"), 1)
    clock.now = 1.5  # "cold" waited a cycle: nothing new passes until the slots drain to it
    late = await started(admission, "held")
    admission.release(1, "a")
    assert not cold.done()  # "held" still runs two
    admission.release(2, "held")
    await asyncio.wait_for(cold, 1)  # first the adapter that waited, then "held" again
    await asyncio.wait_for(late, 1)
    assert admission.active_adapters() == ["cold", "held"]


async def test_a_held_adapter_passing_full_slots_never_lets_another_adapter_through() -> None:
    admission = Admission(
        Limits(max_concurrent=2, adapter_slots=1), resident=lambda key: key == "held"
    )
    await admission.acquire(1, "a")
    await admission.acquire(1, "")
    cold = await started(admission, "cold")  # no slot free
    held = await started(admission, "held")  # no admission slot free
    admission.release(1, "")  # one admission slot: only "held" may take it
    await asyncio.wait_for(held, 1)
    assert admission.active_adapters() == ["a", "held"] and not cold.done()
    cold.cancel()
