"""The one adapter registry behind every protocol and every management route.

It validates adapters before the engine sees them, keeps stable integer ids, preloads and pins,
and keeps at most `max_cpu_loras` adapters resident in the engine, evicting the least recently
used unpinned idle one. Keeping the engine's own CPU cache from overflowing matters: vLLM re-reads
an evicted adapter from disk inside `generate()`, where a failure kills its engine core, so every
non-resident adapter is re-validated and re-added here before a request may use it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from server.core.adapter_files import AdapterRules, check_name, resolve_source, validate_adapter_dir
from server.core.engine import Engine
from server.core.errors import (
    AdapterCapacity,
    AdapterExists,
    AdapterNotFound,
    InvalidRequest,
)
from server.core.types import AdapterHandle


@dataclass(slots=True, kw_only=True)
class AdapterRecord:
    name: str
    src: str
    handle: AdapterHandle
    rank: int
    preload: bool = True
    pin: bool = False
    options: dict[str, str] = field(default_factory=dict)
    resident: bool = False
    removed: bool = False
    inflight: int = 0
    last_used: float = 0.0
    requests: int = 0
    generated_tokens: int = 0
    loads: int = 0
    evictions: int = 0

    def describe(self) -> dict[str, object]:
        """DJL's describe shape (camelCase, null fields omitted)."""
        return {"name": self.name, "src": self.src, "preload": self.preload, "pin": self.pin}


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterLimits:
    enabled: bool
    max_loras: int
    max_cpu_loras: int


class AdapterRegistry:
    def __init__(self, *, engine: Engine, rules: AdapterRules, limits: AdapterLimits) -> None:
        self._engine = engine
        self.rules = rules
        self.limits = limits
        self._records: dict[str, AdapterRecord] = {}
        self._retired: list[AdapterRecord] = []  # unregistered, waiting for in-flight requests
        self._next_id = 1
        self._lock = asyncio.Lock()

    # ---- queries -------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._records)

    def records(self) -> list[AdapterRecord]:
        return list(self._records.values())

    def get(self, name: str) -> AdapterRecord:
        record = self._records.get(name)
        if record is None:
            raise AdapterNotFound(f"The adapter {name} was not found", param="name")
        return record

    def __contains__(self, name: object) -> bool:
        return name in self._records

    # ---- management ------------------------------------------------------------------------
    async def register(
        self,
        name: object,
        src: object,
        *,
        preload: bool = True,
        pin: bool = False,
        options: Mapping[str, str] | None = None,
    ) -> AdapterRecord:
        """Validate and add an adapter. Raises AdapterExists, AdapterInvalid, AdapterCapacity."""
        checked = check_name(name, self.rules)
        self._check_pin_options(preload=preload, pin=pin)
        async with self._lock:
            if checked in self._records:
                raise AdapterExists(
                    f"The adapter {checked} already exists. If you want to replace it, please "
                    "unregistering before registering a new adapter with the same name."
                )
            if pin:
                self._check_pin_capacity()
            record = self._new_record(checked, src, preload=preload, pin=pin, options=options)
            if preload or pin:
                await self._make_resident(record)
            if pin:
                await self._engine.pin_adapter(record.handle)
            self._records[checked] = record
            return record

    async def update(
        self,
        name: str,
        *,
        src: object = None,
        preload: bool | None = None,
        pin: bool | None = None,
        options: Mapping[str, str] | None = None,
    ) -> AdapterRecord:
        """Change source, preload, pin or options. The old state survives any failure."""
        async with self._lock:
            old = self.get(name)
            new_pin = old.pin if pin is None else pin
            new_preload = old.preload if preload is None else preload
            self._check_pin_options(preload=new_preload, pin=new_pin)
            if new_pin and not old.pin:
                self._check_pin_capacity()
            merged = {**old.options, **(options or {})}
            if src is not None and src != old.src or (old.pin and not new_pin):
                record = self._new_record(
                    name, old.src if src is None else src, preload=new_preload, pin=new_pin,
                    options=merged,
                )
            else:
                record = old
                record.preload, record.pin, record.options = new_preload, new_pin, merged
            if new_preload or new_pin:
                await self._make_resident(record)
            if new_pin and (record is not old or not old.pin):
                await self._engine.pin_adapter(record.handle)
            if record is not old:
                self._records[name] = record
                self._retire(old)
            return record

    async def unregister(self, name: str) -> AdapterRecord:
        """Forget the name now; free the engine slot once its in-flight requests finish."""
        async with self._lock:
            record = self.get(name)
            del self._records[name]
            self._retire(record)
            return record

    # ---- request path --------------------------------------------------------------------
    async def acquire(self, name: str) -> AdapterHandle:
        """Make the adapter resident if needed and count a request on it."""
        record = self._records.get(name)
        if record is None:
            raise AdapterNotFound(f"The model `{name}` does not exist.")
        if not record.resident:
            async with self._lock:
                if not record.resident:
                    await self._make_resident(record)
        record.inflight += 1
        record.requests += 1
        record.last_used = time.monotonic()
        return record.handle

    def release(self, handle: AdapterHandle, generated_tokens: int = 0) -> None:
        record = self._find(handle)
        if record is None:
            return
        record.inflight -= 1
        record.generated_tokens += generated_tokens
        record.last_used = time.monotonic()
        if record.removed and record.inflight <= 0:
            asyncio.get_running_loop().create_task(self._unload(record))

    # ---- internals -----------------------------------------------------------------------
    def _new_record(
        self,
        name: str,
        src: object,
        *,
        preload: bool,
        pin: bool,
        options: Mapping[str, str] | None,
    ) -> AdapterRecord:
        path = resolve_source(src, self.rules)
        rank = validate_adapter_dir(path, self.rules)
        handle = AdapterHandle(name=name, int_id=self._next_id, path=str(path))
        self._next_id += 1
        return AdapterRecord(
            name=name, src=str(src), handle=handle, rank=rank, preload=preload, pin=pin,
            options=dict(options or {}),
        )

    def _check_pin_options(self, *, preload: bool, pin: bool) -> None:
        if pin and not preload:
            raise InvalidRequest("Can not set preload to false and pin to true", param="pin")

    def _check_pin_capacity(self) -> None:
        # One engine slot always stays unpinned, or unpinned adapters could never be scheduled.
        pinned = sum(1 for r in self._records.values() if r.pin)
        if pinned + 1 > max(self.limits.max_loras - 1, 0):
            raise AdapterCapacity(
                f"No free lora slots: {pinned} of {self.limits.max_loras} engine slots are "
                "pinned and one must stay free for unpinned adapters"
            )

    async def _make_resident(self, record: AdapterRecord) -> None:
        if record.resident:
            return
        # Files may have changed since registration; re-check before the engine reads them.
        validate_adapter_dir(resolve_source(record.handle.path, self.rules), self.rules)
        await self._evict_for_room()
        await self._engine.add_adapter(record.handle)
        record.resident = True
        record.loads += 1

    async def _evict_for_room(self) -> None:
        resident = [r for r in self._all_records() if r.resident]
        while len(resident) >= self.limits.max_cpu_loras:
            idle = [r for r in resident if not r.pin and r.inflight <= 0]
            if not idle:
                return  # everything busy or pinned: let the engine's own LRU cope for now
            victim = min(idle, key=lambda r: r.last_used)
            await self._engine.remove_adapter(victim.handle)
            victim.resident = False
            victim.evictions += 1
            resident.remove(victim)

    def _all_records(self) -> list[AdapterRecord]:
        return [*self._records.values(), *self._retired]

    def _retire(self, record: AdapterRecord) -> None:
        record.removed = True
        if record.inflight > 0:
            self._retired.append(record)
        else:
            asyncio.get_running_loop().create_task(self._unload(record))

    async def _unload(self, record: AdapterRecord) -> None:
        if record in self._retired:
            self._retired.remove(record)
        if record.resident:
            record.resident = False
            await self._engine.remove_adapter(record.handle)

    def _find(self, handle: AdapterHandle) -> AdapterRecord | None:
        for record in self._all_records():
            if record.handle is handle:
                return record
        return None
