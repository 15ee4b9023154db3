"""Non-streamed generations stop when their client goes away (streams: see `streaming`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.types import Receive

from server.core.errors import ClientClosed
from server.core.timers import DelayQueue

T = TypeVar("T")
# Most answers are ready sooner: watching for the disconnect (a task per request) starts only
# after this long, so a client that leaves is noticed at most this late.
WATCH_AFTER_S = 0.05


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` in this task; if the client disconnects first, cancel it (which aborts its
    engine request) and raise `ClientClosed`. Call only after the body was read: a watcher
    consumes `receive()` to see the disconnect."""
    task = asyncio.current_task()
    assert task is not None
    watch = _Watch(request.receive, task)
    _WATCHES.add(watch)
    try:
        return await work
    except asyncio.CancelledError:
        if not watch.saw_disconnect:
            raise
        task.uncancel()
        raise ClientClosed("The client closed the connection before the response.") from None
    finally:
        watch.stop()


class _Watch:
    """A task that cancels `task` when `receive()` says the client disconnected."""

    __slots__ = ("_receive", "_stopped", "_task", "_watcher", "saw_disconnect")

    def __init__(self, receive: Receive, task: asyncio.Task[object]) -> None:
        self._receive = receive
        self._task = task
        self._watcher: asyncio.Task[None] | None = None
        self._stopped = False
        self.saw_disconnect = False

    def start(self) -> None:
        if not self._stopped:  # the answer was ready first (most are)
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        self._stopped = True
        if self._watcher is not None:
            self._watcher.cancel()

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.saw_disconnect = True
        self._task.cancel()


# every request's watch starts WATCH_AFTER_S after it began: one loop timer for all of them
_WATCHES: DelayQueue[_Watch] = DelayQueue(WATCH_AFTER_S, _Watch.start)
