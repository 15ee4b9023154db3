"""Operations this process asks of the other worker processes serving the same listeners.

A request lives in the worker that accepted its connection, so a call naming it (MindIE's
stopInfer, a stored Responses API answer) may arrive at another worker. Such a call first looks
here, then asks every other worker through `ask`; each runs the operation's local handler. With one
process (`ServerConfig.workers` = 1) there is nobody to ask and `ask` returns nothing. The
transport is the runtime's (server/runtime/worker_link.py); arguments and answers are plain
picklable values.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("gateway")

Handler = Callable[..., Awaitable[Any]]
Remote = Callable[[str, tuple[Any, ...]], Awaitable[list[Any]]]


class Peers:
    def __init__(self, remote: Remote | None = None) -> None:
        """`remote`: how to ask the other workers (server/runtime/worker_link.py); None: alone."""
        self._handlers: dict[str, Handler] = {}
        self._remote = remote

    def handle(self, op: str, handler: Handler) -> None:
        """Run `handler(*args)` here when another worker asks `op`."""
        self._handlers[op] = handler

    async def ask(self, op: str, *args: Any) -> list[Any]:
        """Every other worker's answer to `op` (none with one process)."""
        if self._remote is None:
            return []
        return await self._remote(op, args)

    async def run_here(self, op: str, args: tuple[Any, ...]) -> Any:
        """This worker's answer to another's `op` (None if it has no handler or it failed)."""
        handler = self._handlers.get(op)
        if handler is None:
            return None
        try:
            return await handler(*args)
        except Exception:
            logger.exception("a peer's %s failed here", op)
            return None
