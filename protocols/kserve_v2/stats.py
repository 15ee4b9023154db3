"""Per-model inference statistics for Triton's statistics extension (`…/stats`).

Counted here, for requests served through the Triton routes, keyed by the model named in the path
(the base model or an adapter). Phases of a successful request: `compute_input` (body parsing and
translation), `queue` (admission until the engine's first event), `compute_infer` (the rest of
generation), `compute_output` (encoding). Durations are Triton's `{"count", "ns"}` pairs.
Each worker process counts its own requests; a statistics answer sums every worker's.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from server.core.peers import Peers
from server.http.context import ProtocolContext

PHASES = ("compute_input", "queue", "compute_infer", "compute_output")


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += max(0, ns)

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}

    def plus(self, other: Duration) -> Duration:
        return Duration(self.count + other.count, self.ns + other.ns)


@dataclass(slots=True)
class ModelStats:
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    phases: dict[str, Duration] = field(default_factory=lambda: {p: Duration() for p in PHASES})
    inference_count: int = 0
    last_inference_ms: int = 0

    def plus(self, other: ModelStats) -> ModelStats:
        return ModelStats(
            success=self.success.plus(other.success), fail=self.fail.plus(other.fail),
            phases={p: self.phases[p].plus(other.phases[p]) for p in PHASES},
            inference_count=self.inference_count + other.inference_count,
            last_inference_ms=max(self.last_inference_ms, other.last_inference_ms),
        )


class RequestTimer:
    """Marks the phases of one request; `success()` or `failure()` books it (once)."""

    def __init__(self, stats: InferenceStats, model: str) -> None:
        self._stats = stats
        self._model = model
        self._marks = [stats.clock()]
        self._booked = False

    def mark(self) -> None:
        """End the current phase (in the order of PHASES)."""
        self._marks.append(self._stats.clock())

    def success(self) -> None:
        if not self._booked:
            self._booked = True
            self._stats.book(self._model, [*self._marks, self._stats.clock()], ok=True)

    def failure(self) -> None:
        if not self._booked:
            self._booked = True
            self._stats.book(self._model, [self._marks[0], self._stats.clock()], ok=False)

    def finished(self, ok: bool) -> None:
        """A stream ended (well, or not): end its last phase and book it."""
        self.mark()
        if ok:
            self.success()
        else:
            self.failure()


PEER_STATS = "kserve.stats"  # another worker asks for this one's numbers


class InferenceStats:
    def __init__(
        self, *, clock: Callable[[], int] = time.perf_counter_ns,
        wall: Callable[[], float] = time.time, peers: Peers | None = None,
    ) -> None:
        self.clock = clock
        self._wall = wall
        self._models: dict[str, ModelStats] = {}
        self._peers = peers or Peers()
        self._peers.handle(PEER_STATS, self._mine)

    def timer(self, model: str) -> RequestTimer:
        return RequestTimer(self, model)

    def book(self, model: str, marks: list[int], *, ok: bool) -> None:
        stats = self._models.get(model)
        if stats is None:  # not setdefault: a ModelStats is ten objects, built once per model
            stats = self._models[model] = ModelStats()
        (stats.success if ok else stats.fail).add(marks[-1] - marks[0])
        if ok:  # Triton counts successful inferences only
            stats.inference_count += 1
            stats.last_inference_ms = int(self._wall() * 1000)
            for phase, start, end in zip(PHASES, marks, marks[1:], strict=False):
                stats.phases[phase].add(end - start)

    async def to_json(self, names: Iterable[str], version: str) -> dict[str, Any]:
        """Triton's statistics of `names`, summed over every worker."""
        models = dict(self._models)
        for theirs in await self._peers.ask(PEER_STATS):
            for name, stats in (theirs or {}).items():
                models[name] = models[name].plus(stats) if name in models else stats
        return {"model_stats": [_entry(models, name, version) for name in names]}

    async def _mine(self) -> dict[str, ModelStats]:
        return self._models


def _entry(models: dict[str, ModelStats], name: str, version: str) -> dict[str, Any]:
    stats = models.get(name) or ModelStats()
    phases = {phase: duration.to_json() for phase, duration in stats.phases.items()}
    zero = {"count": 0, "ns": 0}
    return {
        "name": name, "version": version,
        "last_inference": stats.last_inference_ms,
        "inference_count": stats.inference_count,
        "execution_count": stats.inference_count,
        "inference_stats": {
            "success": stats.success.to_json(), "fail": stats.fail.to_json(),
            "queue": phases["queue"], "compute_input": phases["compute_input"],
            "compute_infer": phases["compute_infer"],
            "compute_output": phases["compute_output"],
            "cache_hit": zero, "cache_miss": zero,
        },
        "response_stats": {},
        "batch_stats": [],
        "memory_usage": [],
    }


_SHARED: weakref.WeakKeyDictionary[object, InferenceStats] = weakref.WeakKeyDictionary()


def stats_of(ctx: ProtocolContext) -> InferenceStats:
    """The statistics of one gateway's service: HTTP and gRPC count into the same models."""
    stats = _SHARED.get(ctx.service)
    if stats is None:
        stats = _SHARED[ctx.service] = InferenceStats(peers=ctx.service.peers)
    return stats
