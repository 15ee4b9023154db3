"""`DelayQueue`: many timers of one fixed delay on a single event-loop timer.

A timer per request costs more than it looks (uvloop's `call_later` + `cancel`: about 2 µs, a
few percent of a whole request's work here). When every item waits the same delay, items come
due in the order they were added, so one FIFO and one loop timer (armed for the oldest item)
serve them all. Nothing is cancelled: an item whose work ended first ignores its call (the
callback decides), and an item may be held weakly so a finished request is not kept alive.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class DelayQueue(Generic[T]):
    """Calls `due(item)` `delay_s` after `add(item)` (on the loop running at that time)."""

    def __init__(self, delay_s: float, due: Callable[[T], None]) -> None:
        self.delay_s = delay_s
        self._due = due
        self._items: deque[tuple[float, T]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, item: T) -> None:
        loop = self._loop
        if loop is None or not loop.is_running():
            # the first item, or a new loop (tests run several): any old timer is gone. Not
            # asked every time: asyncio.get_running_loop() costs a getpid() system call.
            loop = self._loop = asyncio.get_running_loop()
            self._items.clear()
            self._timer = None
        at = loop.time() + self.delay_s
        self._items.append((at, item))
        if self._timer is None:
            self._timer = loop.call_at(at, self._fire)

    def __len__(self) -> int:
        return len(self._items)

    def drop(self, keep: Callable[[T], bool]) -> None:
        """Forget the waiting items `keep` rejects (their calls are no longer needed)."""
        self._items = deque(entry for entry in self._items if keep(entry[1]))

    def _fire(self) -> None:
        self._timer = None
        loop = self._loop
        assert loop is not None
        items = self._items
        now = loop.time()
        while items and items[0][0] <= now:
            self._due(items.popleft()[1])
        if items and self._timer is None:
            self._timer = loop.call_at(items[0][0], self._fire)
