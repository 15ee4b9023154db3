"""The one lifecycle every health route reads: state, role and the in-flight count.

STARTING → READY → DRAINING → STOPPED, or FAILED from any state (engine start or engine death).
A drain may begin with a lame-duck period (`ServerConfig.drainDelay`): readiness fails at once,
so balancers take the server out of rotation, but what they still send meanwhile is served.
The role (MindIE PD roles) gates admission: a `decode` instance takes work only from prefill
peers, never new requests from clients.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from enum import StrEnum

PHASES = ("settings", "listeners", "engine import", "engine start", "warm-up", "adapters", "ready")


def log_phase(logger: logging.Logger, phase: str, since: float, detail: str = "") -> float:
    """One start-up progress line, `start-up <phase>: <seconds>s[, detail]`, for a phase of
    `PHASES` that began at `since` (time.monotonic()); returns now, the next phase's start."""
    now = time.monotonic()
    logger.info("start-up %s: %.2fs%s", phase, now - since, f", {detail}" if detail else "")
    return now


class State(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class Role(StrEnum):
    """MindIE instance roles. `flex` (default) serves both prefill and decode."""

    PREFILL = "prefill"
    DECODE = "decode"
    FLEX = "flex"

    @property
    def admits_requests(self) -> bool:
        """Whether clients may send new requests to an instance with this role."""
        return self is not Role.DECODE


class Lifecycle:
    def __init__(self, *, role: Role = Role.FLEX) -> None:
        self.state = State.STARTING
        self._role = role
        self.failure: str | None = None
        self.inflight = 0
        self._lame_duck = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def role(self) -> Role:
        return self._role

    @role.setter
    def role(self, role: Role) -> None:
        self._role = role

    @property
    def accepting(self) -> bool:
        """Ready for traffic: what every readiness probe answers (READY only)."""
        return self.state is State.READY

    @property
    def admitting(self) -> bool:
        """Whether new requests are admitted: when READY, and in a drain's lame-duck period."""
        return self.accepting or (self.state is State.DRAINING and self._lame_duck)

    @property
    def lame_duck(self) -> bool:
        return self._lame_duck

    @property
    def live(self) -> bool:
        return self.state is not State.FAILED

    def switch_role(self, role: Role) -> bool:
        """Take a new role. Refused (False) unless READY: a draining, stopped or failed instance
        keeps the role it had."""
        if self.state is not State.READY:
            return False
        self.role = role
        return True

    def ready(self) -> None:
        if self.state is State.STARTING:
            self.state = State.READY

    def fail(self, reason: str) -> None:
        self.failure = reason
        self.state = State.FAILED

    def begin_drain(self, *, lame_duck: bool = False) -> bool:
        """Fail readiness; stop admitting unless `lame_duck` (and READY: a server still starting
        has no traffic to keep serving) until `end_lame_duck`. Returns False if a drain or stop
        was already under way."""
        if self.state in (State.DRAINING, State.STOPPED):
            return False
        self._lame_duck = lame_duck and self.state is State.READY
        if self.state is not State.FAILED:
            self.state = State.DRAINING
        return True

    def end_lame_duck(self) -> None:
        """Stop admitting new requests (the drain proper)."""
        self._lame_duck = False

    def stopped(self) -> None:
        if self.state is not State.FAILED:
            self.state = State.STOPPED

    def enter(self, count: int = 1) -> None:
        self.inflight += count
        self._idle.clear()

    def leave(self, count: int = 1) -> None:
        self.inflight -= count
        if self.inflight <= 0:
            self.inflight = 0
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight. Returns False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class Shutdown:
    """The stop request: SIGTERM, SIGINT and GET /stopService all land in `request()`.
    Readiness turns 503 at once; new requests are still admitted for `drain_delay_s` (the
    lame-duck period, unless forced); the runtime drains (server/runtime/process.py) and then
    sets `drained`. `force` aborts in-flight requests instead of waiting for them. Idempotent.
    `also` is told of every request (a worker tells its supervisor, which stops every worker)."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        also: Callable[[bool], None] | None = None,
        *,
        drain_delay_s: float = 0.0,
    ) -> None:
        self.lifecycle = lifecycle
        self._also = also
        self.drain_delay_s = drain_delay_s
        self.requested = asyncio.Event()
        self.forced = asyncio.Event()
        self.drained = asyncio.Event()

    def request(self, *, force: bool = False) -> None:
        if self._also is not None and not (self.forced if force else self.requested).is_set():
            self._also(force)
        self.lifecycle.begin_drain(lame_duck=self.drain_delay_s > 0 and not force)
        if force:
            self.lifecycle.end_lame_duck()
            self.forced.set()
        self.requested.set()
