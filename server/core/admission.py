"""Admission: a concurrency limit with a bounded queue in front of it, fair across adapters.

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

The per-adapter queues follow LoRAX's router (predibase/lorax, router/src/queue.rs as of
65d8529a, `AdapterQueuesState`): one FIFO per adapter, an adapter enters the rotation with its
first queued request (`pending_adapters.push_back`) and leaves it once idle. LoRAX passes the
turn on a time slice (`adapter_cycle_time_s`, 2 s) because it swaps adapters in GPU memory, and
within its active set takes the oldest head (`get_oldest_active_adapter`, our `fair=False`
rule); here nothing is swapped at admission (the registry and vLLM's `max_loras` handle
residency), so the turn passes after every grant.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from server.core.errors import Overloaded


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    max_concurrent: int = 256  # requests handed to the engine at once
    max_queue: int = 512  # requests waiting for a slot; beyond: Overloaded (429)
    queue_timeout_s: float = 60.0
    request_timeout_s: float | None = 600.0
    retry_after_s: int = 1
    fair: bool = True  # round-robin over adapters in the queue; False: one FIFO


@dataclass(eq=False, slots=True)
class _Waiter:
    count: int  # slots asked for
    order: int  # arrival number: the oldest head is the smallest
    granted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Admission:
    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        # key -> its waiters, oldest first; the dict's order is the turn order (next first)
        self._queues: dict[str, deque[_Waiter]] = {}
        self._arrivals = itertools.count()
        self.running = 0  # slots held
        self.waiting = 0  # slots asked for by queued requests
        self._watch: Callable[[str, int], None] | None = None

    def watch(self, changed: Callable[[str, int], None]) -> None:
        """Call `changed(key, slots)` after each change to a key's queue, `slots` being what
        its queue now asks for (metrics shared with other processes; `waiting` is updated)."""
        self._watch = changed

    async def acquire(self, count: int = 1, key: str = "") -> None:
        """Take `count` slots for a request on adapter `key` ("" = the base model), waiting
        for its turn in the queue. Raises `Overloaded`."""
        if not self._queues and self._fits(count):
            self.running += count
            return
        if self.waiting + count > self._limits.max_queue:
            raise Overloaded(retry_after_s=self._limits.retry_after_s)
        waiter = _Waiter(count, next(self._arrivals))
        self._queues.setdefault(key, deque()).append(waiter)
        self.waiting += count
        self._changed(key)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), self._limits.queue_timeout_s)
        except BaseException as exc:
            self._leave_queue(key, waiter)
            if isinstance(exc, TimeoutError):
                raise Overloaded("Request timed out waiting in the queue") from None
            raise

    def release(self, count: int = 1) -> None:
        self.running -= count
        while (key := self._next_key()) is not None:
            queue = self._queues[key]
            head = queue[0]
            if not self._fits(head.count):
                return  # it keeps its turn until enough slots are free
            queue.popleft()
            del self._queues[key]
            if queue:
                self._queues[key] = queue  # to the end of the turn order
            self.waiting -= head.count
            self.running += head.count
            head.granted.set_result(None)
            self._changed(key)

    def queued(self) -> dict[str, int]:
        """Slots waiting, per key with waiters."""
        return {key: sum(w.count for w in queue) for key, queue in self._queues.items()}

    @property
    def saturated(self) -> bool:
        """Every slot is taken and the queue is full: the next request gets Overloaded."""
        return self.running >= self._limits.max_concurrent and (
            self.waiting >= self._limits.max_queue
        )

    def _changed(self, key: str) -> None:
        if self._watch is not None:
            queue = self._queues.get(key)
            self._watch(key, sum(w.count for w in queue) if queue else 0)

    def _next_key(self) -> str | None:
        if not self._queues:
            return None
        if self._limits.fair:
            return next(iter(self._queues))
        return min(self._queues, key=lambda k: self._queues[k][0].order)

    def _fits(self, count: int) -> bool:
        return self.running + count <= self._limits.max_concurrent or self.running == 0

    def _leave_queue(self, key: str, waiter: _Waiter) -> None:
        """A waiter gave up (timeout, cancel): drop it, or hand back slots it was just given."""
        if waiter.granted.done():
            self.release(waiter.count)
            return
        queue = self._queues[key]
        queue.remove(waiter)
        if not queue:
            del self._queues[key]
        self.waiting -= waiter.count
        self._changed(key)
        self.release(0)  # the next head may fit now that this waiter is gone
