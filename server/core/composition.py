"""Adapters composed per request (LoRAX's `merged_adapters`), registered like any folder.

A request may name several registered adapters with weights instead of one adapter. The
composed adapter is a normal adapter folder (`adapter_config.json` + `adapter_model.safetensors`)
written by an `AdapterComposer` (the tensor math lives outside the core) into the composition
cache folder, under a digest of the inputs' contents, the weights and the strategy; it is then
registered through the registry (validated exactly like a local folder, same residency and LRU)
under the name `merged-<digest>`. The same composition asked again costs a dictionary look-up.

Composed adapters are internal: they are not listed as models or adapters, no request can name
them, they are not kept in the state file; per-adapter metrics show them by that name. At most
`max_entries` stay registered: the least recently used idle one is unregistered first (its folder
stays in the cache, so asking for it again re-registers it without composing). The cache holds at
most `CACHED_PER_ENTRY * max_entries` folders: the oldest that no registered or still loaded
adapter uses are deleted (a composition whose folder went is composed again).

Only `linear` is served: Σ wᵢ·(αᵢ/rᵢ)·BᵢAᵢ exactly (rank concatenation). LoRAX's `ties`,
`dare_linear` and `dare_ties` trim, sample or elect signs over the dense weight change: their
result is not low-rank (and DARE is random), so no adapter can carry it exactly; they are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from server.core.adapter_files import CONFIG_FILE, AdapterRules, finite_number
from server.core.adapter_records import MERGED_ORIGIN, AdapterRecord, merged_name
from server.core.errors import (
    AdapterExists,
    AdapterInvalid,
    AdapterNotFound,
    GatewayError,
    InvalidRequest,
    ServiceUnavailable,
    Unsupported,
)
from server.core.types import AdapterMerge

logger = logging.getLogger("gateway.adapters")

STRATEGIES = ("linear", "ties", "dare_linear", "dare_ties")  # LoRAX's names
SUPPORTED_STRATEGIES = ("linear",)
SIGN_METHODS = ("total", "frequency")
MAX_MERGED_IDS = 16
CACHED_PER_ENTRY = 4  # folders kept in the cache per registered composed adapter
_FORMAT = 1  # of the composed files: a change of the math gets new cache entries


@dataclass(frozen=True, slots=True)
class MergeInput:
    """One adapter of a composition: its validated folder and its weight."""

    name: str
    path: str
    rank: int
    weight: float


class AdapterComposer(Protocol):
    """Writes the composed adapter folder `out_dir` (atomically: it exists complete or not at
    all). Raises AdapterInvalid when the inputs cannot be composed (shapes that disagree)."""

    def compose(self, inputs: Sequence[MergeInput], out_dir: Path) -> None: ...


# ---- the wire object, shared by every protocol -------------------------------------------------
def merge_from_wire(value: object, *, param: str = "merged_adapters") -> AdapterMerge:
    """LoRAX's `merged_adapters` object → AdapterMerge. Raises InvalidRequest (LoRAX's own
    messages where it has one) or Unsupported (a LoRAX strategy this server does not serve)."""
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"`{param}` must be an object", param=param)
    ids = _ids(value.get("ids"), param)
    weights = _weights(value.get("weights"), len(ids), param)
    strategy = _choice(value.get("merge_strategy"), STRATEGIES, "linear", f"{param}.merge_strategy")
    if strategy not in SUPPORTED_STRATEGIES:
        raise Unsupported(
            f"merge_strategy `{strategy}` is not supported: only `linear` (the exact weighted "
            "sum of the adapters' weight changes) is",
            param=f"{param}.merge_strategy",
        )
    density = value.get("density")
    density = 0.0 if density is None else density
    if not finite_number(density) or not 0.0 <= float(density) <= 1.0:
        raise InvalidRequest("`density` must be >= 0.0 and <= 1.0", param=f"{param}.density")
    sign = _choice(
        value.get("majority_sign_method"), SIGN_METHODS, "total", f"{param}.majority_sign_method"
    )
    return AdapterMerge(
        ids=ids, weights=weights, strategy=strategy, density=float(density),
        majority_sign_method=sign,
    )


def _ids(value: object, param: str) -> tuple[str, ...]:
    if value is None or value == []:
        raise InvalidRequest(
            "at least one adapter ID must be provided when setting `adapters`", param=f"{param}.ids"
        )
    if not isinstance(value, list) or not all(isinstance(i, str) and i for i in value):
        raise InvalidRequest("`ids` must be a list of adapter names", param=f"{param}.ids")
    if len(value) > MAX_MERGED_IDS:
        raise InvalidRequest(
            f"at most {MAX_MERGED_IDS} adapters may be merged, got {len(value)}",
            param=f"{param}.ids",
        )
    return tuple(value)


def _weights(value: object, count: int, param: str) -> tuple[float, ...]:
    if value is None:
        return (1.0,) * count  # LoRAX's documented default
    if not isinstance(value, list) or not all(finite_number(w) for w in value):
        raise InvalidRequest(
            "`weights` must be a list of finite numbers", param=f"{param}.weights"
        )
    if len(value) != count:
        raise InvalidRequest(
            "number of adapter IDs must match number of adapter weights", param=f"{param}.weights"
        )
    return tuple(float(w) for w in value)


def _choice(value: object, allowed: tuple[str, ...], default: str, param: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str) or value.lower() not in allowed:
        name = param.rsplit(".", 1)[-1]
        raise InvalidRequest(f"`{name}` must be one of {list(allowed)}", param=param)
    return value.lower()


def merge_key(digests: Sequence[str], merge: AdapterMerge) -> str:
    """The composed adapter's identity: the inputs' contents, their exact weights and the
    strategy (`density` and `majority_sign_method` do not change a `linear` result)."""
    spec = {
        "format": _FORMAT,
        "strategy": merge.strategy,
        "inputs": [[d, w.hex()] for d, w in zip(digests, merge.weights, strict=True)],
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


class ComposingRegistry(Protocol):
    """What a composition needs of the registry it registers composed adapters in."""

    rules: AdapterRules

    async def ensure(self, name: str) -> AdapterRecord: ...

    def is_merged(self, name: str) -> bool: ...

    def merged_records(self) -> list[AdapterRecord]: ...

    def paths_in_use(self) -> set[str]: ...

    async def register(  # noqa: PLR0913 - the registry's signature
        self, name: object, src: object, *, preload: bool = True, pin: bool = False,
        options: Mapping[str, str] | None = None, alias: str | None = None, origin: str = "api",
    ) -> AdapterRecord: ...

    async def unregister(self, name: str) -> AdapterRecord: ...


# ---- composition and its cache --------------------------------------------------------------
class Composition:
    """Builds, caches and registers composed adapters for one registry (the owner's)."""

    def __init__(self, composer: AdapterComposer, folder: Path, *, max_entries: int) -> None:
        self._composer = composer
        self.folder = folder
        self.max_entries = max_entries
        self._building: dict[str, asyncio.Future[None]] = {}  # one build per key

    async def compose(self, registry: ComposingRegistry, merge: AdapterMerge) -> str:
        """The registered name of the composed adapter, composed and registered first if it
        is new; concurrent requests for one composition share one build."""
        records = [await registry.ensure(name) for name in merge.ids]
        self._check_rank(records, registry.rules.max_rank)
        key = merge_key([r.digest for r in records], merge)
        name = merged_name(key)
        if registry.is_merged(name):
            if (self.folder / key / CONFIG_FILE).is_file():
                return name
            with contextlib.suppress(AdapterNotFound):  # another request did it first
                await registry.unregister(name)  # its folder was deleted: compose it again
        pending = self._building.get(key)
        if pending is None:
            inputs = [
                MergeInput(r.name, r.handle.path, r.rank, w)
                for r, w in zip(records, merge.weights, strict=True)
            ]
            pending = asyncio.ensure_future(self._build(registry, inputs, key, name))
            self._building[key] = pending
            pending.add_done_callback(lambda _: self._building.pop(key, None))
        await asyncio.shield(pending)
        return name

    @staticmethod
    def _check_rank(records: Sequence[AdapterRecord], max_rank: int) -> None:
        total = sum(r.rank for r in records)
        if total > max_rank:
            parts = ", ".join(f"{r.name} ({r.rank})" for r in records)
            raise AdapterInvalid(
                f"The merged adapter's rank {total} (the sum of the ranks of {parts}) is "
                f"greater than max_lora_rank {max_rank}.",
                param="merged_adapters.ids",
            )

    async def _build(
        self, registry: ComposingRegistry, inputs: Sequence[MergeInput], key: str, name: str
    ) -> None:
        out_dir = self.folder / key
        if not (out_dir / CONFIG_FILE).is_file():
            try:
                await asyncio.to_thread(self._write, inputs, out_dir)
            except OSError as exc:
                logger.error("the merged adapter %s could not be written: %s", name, exc)
                raise ServiceUnavailable(
                    "The merged adapter could not be written to the composition cache"
                ) from None
            logger.info("adapter %s composed from %s", name, [(i.name, i.weight) for i in inputs])
        await self._make_room(registry, keep=name)
        await asyncio.to_thread(self._prune, registry.paths_in_use() | {str(out_dir.resolve())})
        try:
            await registry.register(name, str(out_dir), preload=False, origin=MERGED_ORIGIN)
        except AdapterExists:
            if not registry.is_merged(name):
                raise  # a management call took the name: say so
        except GatewayError as exc:  # not expected: the composer writes what validation takes
            logger.error("the merged adapter %s was refused: %s", name, exc.message)
            raise

    def _write(self, inputs: Sequence[MergeInput], out_dir: Path) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._composer.compose(inputs, out_dir)

    def _prune(self, in_use: set[str]) -> None:
        """Delete the oldest cached folders beyond the bound that nothing uses."""
        try:
            entries = sorted(
                (p for p in self.folder.iterdir() if p.is_dir() and not p.name.startswith(".")),
                key=lambda p: p.stat().st_mtime,
            )
        except OSError:  # a folder deleted meanwhile (servers may share the cache)
            logger.warning("the composition cache %s could not be listed", self.folder)
            return
        excess = len(entries) - CACHED_PER_ENTRY * self.max_entries
        for entry in entries:
            if excess <= 0:
                return
            if str(entry.resolve()) not in in_use:
                shutil.rmtree(entry, ignore_errors=True)
                excess -= 1

    async def _make_room(self, registry: ComposingRegistry, *, keep: str) -> None:
        """Unregister least recently used idle composed adapters beyond `max_entries - 1`."""
        merged = [r for r in registry.merged_records() if r.name != keep]
        excess = len(merged) - (self.max_entries - 1)
        idle = sorted((r for r in merged if r.inflight == 0), key=lambda r: r.last_used)
        for record in idle[: max(excess, 0)]:
            try:
                await registry.unregister(record.name)
            except AdapterNotFound:
                continue
