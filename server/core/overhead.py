"""`EngineWait`: how long one request has waited on the engine, so the listener app can tell the
client the gateway's own share of the time (the `X-Gateway-Overhead-Ms` header).

The listener app puts a fresh `EngineWait` in `engine_wait_var` per request; the service marks
the intervals the request waits on the engine (an admission slot, an adapter load into the
engine) and the request's event streams mark each wait for the engine's next output until the
response's headers are due (a stream stops measuring once primed, so streamed tokens cost
nothing). Concurrent waits (the streams of a batch) count once: the clock keeps the union of
the intervals, not their sum.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class EngineWait:
    """The union of a request's waits on the engine, in seconds (`perf_counter`)."""

    __slots__ = ("_open", "_since", "seconds")

    def __init__(self) -> None:
        self._open = 0
        self._since = 0.0
        self.seconds = 0.0

    def enter(self) -> None:
        if self._open == 0:
            self._since = time.perf_counter()
        self._open += 1

    def leave(self) -> None:
        self._open -= 1
        if self._open == 0:
            self.seconds += time.perf_counter() - self._since

    def total(self, now: float) -> float:
        """The time waited up to `now`, a wait still open included."""
        return self.seconds + (now - self._since if self._open else 0.0)


engine_wait_var: contextvars.ContextVar[EngineWait | None] = contextvars.ContextVar(
    "engine_wait", default=None
)


async def on_engine(awaitable: Awaitable[T]) -> T:
    """Await `awaitable` as a wait on the engine of the current request (if it is measured)."""
    wait = engine_wait_var.get()
    if wait is None:
        return await awaitable
    wait.enter()
    try:
        return await awaitable
    finally:
        wait.leave()
