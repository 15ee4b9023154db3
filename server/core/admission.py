"""Admission: a concurrency limit with a bounded queue in front of it, fair across adapters, and
(adapter slots) at most as many distinct adapters in flight as the engine runs in one step.

A request takes one slot, a batch of k prompts takes k slots at once (so a batch's prompts
start together and two batches never each hold half of what they need). A batch larger than
the whole limit is admitted when nothing else runs. Beyond `max_queue` waiting slots (all
adapters together), or after `queue_timeout_s` in the queue, the answer is `Overloaded` (429
with Retry-After).

Waiters queue per key: the adapter a request runs on, the base model being one key. Each key's
queue is FIFO. With `Limits.fair` (the default) a freed slot goes to the head of the next key in
turn, round-robin over the keys that have waiters: a key joins the end of the turn order with
its first waiter, moves to the end after each grant and leaves when its queue is empty. So a
cold adapter's request waits for at most one grant to each key ahead of it, not for a hot
adapter's whole backlog. Without `fair` the oldest head of all queues goes first: one FIFO.
Either way a head that does not fit the free slots (a batch) waits and nothing overtakes
it, and with a single key both are the same FIFO.

Adapter slots (`Limits.adapter_slots`, `LoraConfig.maxActiveAdapters`; 0 = off): at most that
many distinct adapters in flight. An adapter key takes an adapter slot with its first grant and
keeps it while it has requests running or waiting; requests of an adapter without a slot wait
in the gateway's queue, and the next adapters in turn are loaded ahead (`prefetch`) into the
engine's cached places the active ones leave. The base model needs no slot. An adapter that
held its slot for `cycle_s` while another adapter waits for one gets no new grants: its
running requests finish, then the slot goes to a waiting adapter: one whose oldest request
waited a cycle, the oldest first, else the one with the most requests waiting (one load serves
them all and they run together in the engine's batch; LoRAX takes its pending adapters in
arrival order). So an adapter's request waits for at most a cycle and then
`ceil(overdue adapters ahead / slots)` more (each a cycle plus the drain of the running
requests), however hot the others are, and the engine never holds
more adapters than it has cached places (which would leave requests waiting in the registry
for a place, in no order). An adapter the engine holds already (`resident`; the gateway asks the
registry when the slots stand for the engine's cached places, the default) is admitted beyond
the slots, since it takes no place from anyone, unless an adapter waited a
cycle for a slot: then nothing new passes until the slots drained to it. With no more adapters
than slots nothing changes.

Why the default is the engine's cached places (`maxCpuLoras`), not its `maxLoras`: vLLM runs
at most `max_loras` distinct adapters per step and leaves the others' requests in its own
queue, with their weights already loaded; when a running adapter's requests end, the engine
schedules a queued adapter's in its next step. With only `max_loras` adapters in flight, the
next adapter's requests reach the engine only after the gateway saw the last ones end, and
the engine ran short of requests meanwhile: on the demo model at 32 adapters over 2 slots
(bench L) that ran at 0.59 of the rate without slots, while 4 in flight matched that rate with
a third of its TTFT p99 (bench/ANALYSIS.md). `maxLoras` stays available as the strict setting.

The per-adapter queues follow LoRAX's router (predibase/lorax, router/src/queue.rs as of
65d8529a, `AdapterQueuesState`): one FIFO per adapter, an adapter enters the rotation with its
first queued request (`pending_adapters.push_back`) and leaves it once idle; a bounded set of
active adapters (`max_active_adapters`) swapped on a cycle (`adapter_cycle_time_s`, 2 s), an
adapter past its cycle leaving the active set once it has nothing running and another is
pending. LoRAX still grants an adapter past its cycle when no active adapter within its cycle
has waiters; here it gets nothing while another adapter waits, so its slot drains and the bound
above holds under any load. Within the active set LoRAX takes the oldest head
(`get_oldest_active_adapter`, our `fair=False` rule).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from server.core.errors import Overloaded

BASE = ""  # the base model's key: it needs no adapter slot


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    max_concurrent: int = 256  # requests handed to the engine at once
    max_queue: int = 512  # requests waiting for a slot; beyond: Overloaded (429)
    queue_timeout_s: float = 60.0
    request_timeout_s: float | None = 600.0
    retry_after_s: int = 1
    fair: bool = True  # round-robin over adapters in the queue; False: one FIFO
    adapter_slots: int = 0  # distinct adapters in flight at once (maxLoras); 0 = no limit
    cycle_s: float = 2.0  # how long an adapter keeps its slot while others wait for one
    prefetch: int = 0  # waiting adapters loaded ahead of their turn


class AdmissionWatcher(Protocol):
    """What admission reports, for metrics (implemented outside the core)."""

    def queue_changed(self, key: str, slots: int) -> None:
        """A key's queue changed; it now asks for `slots` (`Admission.waiting` is updated)."""

    def adapter_waited(self, key: str, seconds: float) -> None:
        """A request on adapter `key` was admitted after `seconds` in the queue (0: at once)."""

    def adapter_rotated(self, key: str) -> None:
        """Adapter `key` waited for an adapter slot and took one."""


@dataclass(eq=False, slots=True)
class _Waiter:
    count: int  # slots asked for
    order: int  # arrival number: the oldest head is the smallest
    since: float  # when it joined the queue (the admission's clock)
    granted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass(slots=True)
class _AdapterSlot:
    since: float  # when the adapter took it
    running: int = 0  # admission slots held by requests on the adapter


class Admission:
    def __init__(
        self, limits: Limits, prefetch: Callable[[str], Awaitable[bool]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        resident: Callable[[str], bool] = lambda key: False,
    ) -> None:
        """`prefetch(key)`: load adapter `key` now, its turn is near (with adapter slots);
        False: no room yet, ask again at the next change. `resident(key)`: whether the engine
        holds adapter `key` now."""
        self._limits = limits
        self._resident = resident
        self._clock = clock
        self._prefetch = prefetch if limits.adapter_slots and limits.prefetch else None
        # key -> its waiters, oldest first; the dict's order is the turn order (next first)
        self._queues: dict[str, deque[_Waiter]] = {}
        self._arrivals = itertools.count()
        self.running = 0  # slots held
        self.waiting = 0  # slots asked for by queued requests
        self._slots: dict[str, _AdapterSlot] = {}  # adapter key -> the slot it holds
        self._prefetched: set[str] = set()  # waiting adapters loaded (or loading) ahead
        self._prefetching: set[asyncio.Task[None]] = set()
        self._watcher: AdmissionWatcher | None = None

    def watch(self, watcher: AdmissionWatcher) -> None:
        """Report to `watcher` from now on (the metrics, built after admission)."""
        self._watcher = watcher

    def try_acquire(self, count: int = 1, key: str = BASE) -> bool:
        """Take `count` slots for a request on adapter `key` if it need not wait (most requests:
        no coroutine to await); False leaves it to `acquire`."""
        return self._take_now(count, key, self._clock())

    async def acquire(self, count: int = 1, key: str = BASE) -> None:
        """Take `count` slots for a request on adapter `key` ("" = the base model), waiting
        for its turn in the queue. Raises `Overloaded`."""
        now = self._clock()
        if self._take_now(count, key, now):
            return
        if self.waiting + count > self._limits.max_queue:
            raise Overloaded(retry_after_s=self._limits.retry_after_s)
        waiter = _Waiter(count, next(self._arrivals), now)
        self._queues.setdefault(key, deque()).append(waiter)
        self.waiting += count
        self._changed(key)
        self._prefetch_next(now)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), self._limits.queue_timeout_s)
        except BaseException as exc:
            self._leave_queue(key, waiter)
            if isinstance(exc, TimeoutError):
                raise Overloaded("Request timed out waiting in the queue") from None
            raise

    def _take_now(self, count: int, key: str, now: float) -> bool:
        if self._fits(count) and self._may_start(key, now) and (
            not self._queues or self._next_key(now) is None  # nobody it may overtake waits
        ):
            self._grant(key, count, now)
            return True
        return False

    def release(self, count: int = 1, key: str = BASE) -> None:
        self.running -= count
        slot = self._slots.get(key)
        if slot is not None:
            slot.running -= count
        self._grant_waiters()

    def queued(self) -> dict[str, int]:
        """Slots waiting, per key with waiters."""
        return {key: sum(w.count for w in queue) for key, queue in self._queues.items()}

    def active_adapters(self) -> list[str]:
        """The adapter keys holding an adapter slot, in the order they took it."""
        return list(self._slots)

    @property
    def saturated(self) -> bool:
        """Every slot is taken and the queue is full: the next request gets Overloaded."""
        return self.running >= self._limits.max_concurrent and (
            self.waiting >= self._limits.max_queue
        )

    def _grant_waiters(self) -> None:
        if not self._queues and not self._slots:
            return
        now = self._clock()
        self._free_adapter_slots(now)
        while (key := self._next_key(now)) is not None:
            queue = self._queues[key]
            head = queue[0]
            if not self._fits(head.count):
                return  # it keeps its turn until enough slots are free
            queue.popleft()
            del self._queues[key]
            if queue:
                self._queues[key] = queue  # to the end of the turn order
            self.waiting -= head.count
            self._grant(key, head.count, now, waited_since=head.since)
            head.granted.set_result(None)
            self._changed(key)
        self._prefetch_next(now)

    def _grant(
        self, key: str, count: int, now: float, waited_since: float | None = None
    ) -> None:
        self.running += count
        if key == BASE:
            return
        if self._limits.adapter_slots:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _AdapterSlot(now)
                self._prefetched.discard(key)
                if waited_since is not None and self._watcher is not None:
                    self._watcher.adapter_rotated(key)
            slot.running += count
        if self._watcher is not None:
            self._watcher.adapter_waited(key, 0.0 if waited_since is None else now - waited_since)

    def _free_adapter_slots(self, now: float) -> None:
        """Slots of adapters with nothing running that have nothing waiting either, or had
        their cycle while another adapter waits, go back."""
        for key in [
            k for k, slot in self._slots.items()
            if slot.running <= 0 and (k not in self._queues or self._closing(slot, now))
        ]:
            del self._slots[key]

    def _may_start(self, key: str, now: float, overdue: bool | None = None) -> bool:
        """Whether a request on `key` may take slots now as far as adapter slots go.
        `overdue`: `_overdue(now)` if the caller has it (asked of every waiting key)."""
        if not self._limits.adapter_slots or key == BASE:
            return True
        slot = self._slots.get(key)
        if slot is not None:
            return not self._closing(slot, now)
        if self._slot_free():
            return True
        # the engine holds it already: admitting it takes no cached place from anyone, unless
        # an adapter waited a cycle for a slot (then the slots must drain to it)
        if not self._resident(key):
            return False
        return not (self._overdue(now) if overdue is None else overdue)

    def _slotless(self) -> Iterator[str]:
        """Adapter keys with waiters and no slot, in turn order."""
        return (k for k in self._queues if k != BASE and k not in self._slots)

    def _waited_a_cycle(self, key: str, now: float) -> bool:
        return now - self._queues[key][0].since >= self._limits.cycle_s

    def _overdue(self, now: float) -> bool:
        """An adapter without a slot waited a cycle for one."""
        return any(self._waited_a_cycle(k, now) for k in self._slotless())

    def _closing(self, slot: _AdapterSlot, now: float) -> bool:
        """The adapter had its cycle and another adapter waits for a slot."""
        return now - slot.since >= self._limits.cycle_s and any(True for _ in self._slotless())

    def _waiting_adapters(self, now: float, count: int) -> list[str]:
        """The first `count` adapter keys with waiters and no slot, in the order they take a
        free slot: those whose oldest request waited a cycle, oldest first; then the most
        requests waiting first (one load serves them all, one slot runs them together), in
        turn order among equals (`nsmallest` is a stable sort's first `count`)."""
        cycle_s = self._limits.cycle_s

        def rank(key: str) -> tuple[int, float]:
            queue = self._queues[key]
            since = queue[0].since
            return (0, since) if now - since >= cycle_s else (1, -len(queue))

        return heapq.nsmallest(count, self._slotless(), key=rank)

    def _prefetch_next(self, now: float) -> None:
        """Ask for the next waiting adapters to be loaded ahead of their turn (once each)."""
        if self._prefetch is None:
            return
        for key in self._waiting_adapters(now, self._limits.prefetch):
            if key not in self._prefetched:
                self._prefetched.add(key)
                task = asyncio.get_running_loop().create_task(self._load_ahead(self._prefetch, key))
                self._prefetching.add(task)
                task.add_done_callback(self._prefetching.discard)

    async def _load_ahead(self, prefetch: Callable[[str], Awaitable[bool]], key: str) -> None:
        if not await prefetch(key):
            self._prefetched.discard(key)  # no room yet: the next change asks again

    def _changed(self, key: str) -> None:
        if self._watcher is not None:
            queue = self._queues.get(key)
            self._watcher.queue_changed(key, sum(w.count for w in queue) if queue else 0)

    def _next_key(self, now: float) -> str | None:
        overdue = bool(self._limits.adapter_slots) and self._overdue(now)
        keys: Iterable[str] = self._queues
        if overdue and not self._slot_free():  # only the base model and slot holders may start
            keys = (k for k in keys if k == BASE or k in self._slots)
        keys = (k for k in keys if self._may_start(k, now, overdue))
        key = (
            next(keys, None) if self._limits.fair
            else min(keys, key=lambda k: self._queues[k][0].order, default=None)
        )
        if key is None:
            return None
        if key != BASE and key not in self._slots and self._slot_free():
            return self._waiting_adapters(now, 1)[0]  # which adapter takes the free slot
        return key  # without a free slot, an adapter the engine holds passes (`_may_start`)

    def _slot_free(self) -> bool:
        return len(self._slots) < self._limits.adapter_slots

    def _fits(self, count: int) -> bool:
        return self.running + count <= self._limits.max_concurrent or self.running == 0

    def _leave_queue(self, key: str, waiter: _Waiter) -> None:
        """A waiter gave up (timeout, cancel): drop it, or hand back slots it was just given."""
        if waiter.granted.done():
            self.release(waiter.count, key)
            return
        queue = self._queues[key]
        queue.remove(waiter)
        if not queue:
            del self._queues[key]
            self._prefetched.discard(key)
        self.waiting -= waiter.count
        self._changed(key)
        self.release(0, key)  # the next head may fit now that this waiter is gone
