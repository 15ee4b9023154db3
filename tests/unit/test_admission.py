"""Admission on its own: the bounded queue, its order across adapters (round-robin or one FIFO),
timeouts, cancellation and batches."""

from __future__ import annotations

import asyncio

import pytest

from server.core.admission import Admission, Limits
from server.core.errors import Overloaded

pytestmark = pytest.mark.anyio


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
    seen: list[tuple[str, int, int]] = []
    admission.watch(lambda key, slots: seen.append((key, slots, admission.waiting)))
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
