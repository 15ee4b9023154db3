"""`/health/timed`'s probe: a real one-token generation, run at most once at a time and reused
while it is fresh, so that an open route cannot be used to load the engine.

Callers that arrive while a probe runs wait for that probe (each within its own wait time); a
result younger than `REUSE_S` answers without running another. Each worker process has its own
gate, so N workers run at most N probes at a time.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from server.core.errors import GatewayError, Overloaded
from server.core.service import InferenceService
from server.core.types import GenerationRequest, Sampling, TextPrompt

REUSE_S = 1.0  # a probe result younger than this answers the next probes


@dataclass(frozen=True, slots=True)
class ProbeResult:
    failure: str | None = None  # None: healthy (also when merely busy)


async def probe(service: InferenceService, seconds: int) -> ProbeResult:
    """A real one-token generation within `seconds` (an engine check when the role takes no
    requests)."""
    if not service.lifecycle.role.admits_requests:
        try:
            await asyncio.wait_for(service.check_health(), seconds)
        except (GatewayError, TimeoutError) as exc:
            return ProbeResult(f"Engine health check failed: {exc}")
        return ProbeResult()
    request = GenerationRequest(
        request_id=f"health-{uuid.uuid4().hex[:16]}",
        model="",
        prompt=TextPrompt("health"),
        sampling=Sampling(max_new_tokens=1, temperature=0.0),
        protocol="health",
        timeout_s=float(seconds),
    )
    try:
        await asyncio.wait_for(service.generate(request), seconds)
    except Overloaded:
        return ProbeResult()
    except TimeoutError:
        return ProbeResult(f"The health probe did not finish within {seconds} s")
    except GatewayError as exc:
        return ProbeResult(f"The health probe failed: {exc.message}")
    return ProbeResult()


class ProbeGate:
    """One probe at a time; a result younger than `reuse_s` is reused."""

    def __init__(
        self,
        service: InferenceService,
        *,
        reuse_s: float = REUSE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._service = service
        self._reuse_s = reuse_s
        self._clock = clock
        self._running: asyncio.Task[ProbeResult] | None = None
        self._last: tuple[float, ProbeResult] | None = None

    async def check(self, seconds: int) -> ProbeResult:
        """The fresh result, else the running probe's (waited for at most `seconds`), else a
        new probe's, bounded by `seconds` itself."""
        if self._last is not None and self._clock() - self._last[0] < self._reuse_s:
            return self._last[1]
        running = self._running
        if running is not None:
            try:
                return await asyncio.wait_for(asyncio.shield(running), seconds)
            except TimeoutError:
                return ProbeResult(f"The health probe did not finish within {seconds} s")
        running = self._running = asyncio.create_task(probe(self._service, seconds))
        running.add_done_callback(self._finished)
        # shielded: a caller that goes away leaves the probe to those waiting for it
        return await asyncio.shield(running)

    def _finished(self, task: asyncio.Task[ProbeResult]) -> None:
        self._running = None
        if not task.cancelled() and task.exception() is None:
            self._last = (self._clock(), task.result())
