"""What the adapter registry knows of each adapter, and the values it hands out: the records,
their residency, the per-adapter numbers, the folder refusals, the limits."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from enum import StrEnum

from server.core.adapter_files import Fingerprint
from server.core.types import AdapterHandle

# AdapterRecord.origin of a composed adapter (server/core/composition.py)
MERGED_ORIGIN = "merged"
# the names composed adapters are registered under: no management call may take one
MERGED_NAME = re.compile(r"merged-[0-9a-f]{16}")


def merged_name(key: str) -> str:
    """The registered name of the composed adapter whose (hex) composition key is `key`."""
    return f"merged-{key[:16]}"


# Upper bounds (seconds) of the load-latency histogram (validation + the engine's add_adapter).
LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Residency(StrEnum):
    """Where an adapter is. ENGINE_SLOT: it has requests in the engine (in a slot or queued
    for one); CPU_CACHE: loaded in the engine's cache, idle; REGISTERED: known, not loaded."""

    ENGINE_SLOT = "engine_slot"
    CPU_CACHE = "cpu_cache"
    REGISTERED = "registered"


@dataclass(slots=True, kw_only=True)
class AdapterRecord:
    name: str
    src: str  # as the operator gave it
    handle: AdapterHandle  # handle.path is the resolved directory
    rank: int
    preload: bool = True
    pin: bool = False
    options: dict[str, str] = field(default_factory=dict)
    alias: str | None = None  # display alias (X-Amzn-SageMaker-Adapter-Alias)
    # api: a management call; config: the config file; folder: adapterDir; merged: composed
    # for requests (server/core/composition.py: never listed, never named by a request)
    origin: str = "api"
    digest: str = ""  # of the files: the engine identity (handle.int_id) follows it
    fingerprint: Fingerprint = ()  # stat of the files when digested
    resident: bool = False
    removed: bool = False
    inflight: int = 0
    registered_at: float = field(default_factory=time.time)
    last_used: float = 0.0
    last_used_step: int = 0  # the engine's step count (Engine.steps) at `last_used`
    requests: int = 0
    generated_tokens: int = 0
    loads: int = 0
    cold_loads: int = 0  # loads a request waited for (not a preload)
    prefetches: int = 0  # loads started ahead of the adapter's turn in the admission queue
    prefetched: bool = False  # loaded ahead and not used since: another prefetch keeps out
    evictions: int = 0
    load_failures: int = 0
    load_buckets: list[int] = field(default_factory=lambda: [0] * len(LOAD_BUCKETS))
    load_seconds: float = 0.0  # total time of the loads

    @property
    def residency(self) -> Residency:
        if not self.resident:
            return Residency.REGISTERED
        return Residency.ENGINE_SLOT if self.inflight > 0 else Residency.CPU_CACHE

    @property
    def display_name(self) -> str:
        return self.alias or self.name

    def snapshot(self) -> AdapterSnapshot:
        return AdapterSnapshot(
            name=self.name, int_id=self.handle.int_id, residency=self.residency, pinned=self.pin,
            rank=self.rank, inflight=self.inflight, requests=self.requests,
            generated_tokens=self.generated_tokens, loads=self.loads, evictions=self.evictions,
            load_failures=self.load_failures, last_used=self.last_used,
            cold_loads=self.cold_loads, load_buckets=tuple(self.load_buckets),
            load_seconds=self.load_seconds, prefetches=self.prefetches,
        )

    def count_load(self, seconds: float, *, cold: bool) -> None:
        self.loads += 1
        self.cold_loads += cold
        self.load_seconds += seconds
        for index, bound in enumerate(LOAD_BUCKETS):
            if seconds <= bound:
                self.load_buckets[index] += 1


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistryView:
    """A registry's names, aliases and refusals, as another worker process shows them."""

    records: tuple[AdapterRecord, ...]
    aliases: dict[str, str]
    failed: dict[str, Failure]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterSnapshot:
    """Per-adapter numbers for metrics (counters are totals since registration)."""

    name: str
    int_id: int
    residency: Residency
    pinned: bool
    rank: int
    inflight: int
    requests: int
    generated_tokens: int
    loads: int
    evictions: int
    load_failures: int
    last_used: float  # time.monotonic() of the last request, 0.0 if never used
    cold_loads: int = 0
    load_buckets: tuple[int, ...] = ()  # cumulative counts per LOAD_BUCKETS bound
    load_seconds: float = 0.0
    prefetches: int = 0


@dataclass(frozen=True, slots=True)
class Failure:
    """A folder adapter that was refused: why, and the files' state then (a change retries)."""

    path: str
    reason: str
    fingerprint: Fingerprint


@dataclass(frozen=True, slots=True)
class SyncReport:
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    reloaded: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterLimits:
    enabled: bool
    max_loras: int  # engine slots: distinct adapters in one engine step (vLLM enforces it)
    max_cpu_loras: int  # adapters held in the engine at once (this registry enforces it)
    wait_s: float = 60.0  # how long a request waits for a free cached place
    # an adapter stays in the engine after its last request until the engine completed
    # SETTLE_STEPS steps or, at the latest, this long (server/core/adapter_residency.py)
    settle_s: float = 0.25
    # folders whose sub-directories are adapters by name: served on first request and kept in
    # sync by `sync_folders` (adapterDir, then the model folder's adapters/); () = off
    discovery_dirs: tuple[str, ...] = ()
    on_demand: bool = True  # a request may name a folder of them that is not registered yet

    @property
    def max_pins(self) -> int:
        """Pins may take at most `max_loras` places and must leave one for unpinned adapters."""
        return max(0, min(self.max_loras, self.max_cpu_loras - 1))

