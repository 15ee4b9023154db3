"""Admission: a concurrency limit with a bounded FIFO queue in front of it.

A request takes one slot, a batch of k prompts takes k slots at once (so a batch's prompts
start together and two batches never each hold half of what they need). A batch larger than
the whole limit is admitted when nothing else runs. Beyond `max_queue` waiting slots, or after
`queue_timeout_s` in the queue, the answer is `Overloaded` (429 with Retry-After).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from server.core.errors import Overloaded


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    max_concurrent: int = 256  # requests handed to the engine at once
    max_queue: int = 512  # requests waiting for a slot; beyond: Overloaded (429)
    queue_timeout_s: float = 60.0
    request_timeout_s: float | None = 600.0
    retry_after_s: int = 1


class Admission:
    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self.running = 0  # slots held
        self.waiting = 0  # slots asked for by queued requests

    async def acquire(self, count: int = 1) -> None:
        """Take `count` slots, waiting in FIFO order. Raises `Overloaded`."""
        if not self._waiters and self._fits(count):
            self.running += count
            return
        if self.waiting + count > self._limits.max_queue:
            raise Overloaded(retry_after_s=self._limits.retry_after_s)
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (count, granted)
        self._waiters.append(entry)
        self.waiting += count
        try:
            await asyncio.wait_for(asyncio.shield(granted), self._limits.queue_timeout_s)
        except BaseException as exc:
            self._leave_queue(entry)
            if isinstance(exc, TimeoutError):
                raise Overloaded("Request timed out waiting in the queue") from None
            raise

    def release(self, count: int = 1) -> None:
        self.running -= count
        while self._waiters and self._fits(self._waiters[0][0]):
            count_next, granted = self._waiters.popleft()
            self.waiting -= count_next
            self.running += count_next
            granted.set_result(None)

    @property
    def saturated(self) -> bool:
        """Every slot is taken and the queue is full: the next request gets Overloaded."""
        return self.running >= self._limits.max_concurrent and (
            self.waiting >= self._limits.max_queue
        )

    def _fits(self, count: int) -> bool:
        return self.running + count <= self._limits.max_concurrent or self.running == 0

    def _leave_queue(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        """A waiter gave up (timeout, cancel): drop it, or hand back slots it was just given."""
        count, granted = entry
        if granted.done():
            self.release(count)
            return
        self._waiters.remove(entry)
        self.waiting -= count
        self.release(0)  # the head may fit now that this waiter is gone
