"""The model-server contract LoRA-aware routers read from `/metrics`, per server (not per worker).

The Gateway API Inference Extension's model server protocol
(kubernetes-sigs/gateway-api-inference-extension, docs/proposals/003-model-server-protocol) and
llm-d's scorers read vLLM's names: `vllm:num_requests_waiting` (queue depth),
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:cache_config_info` and
`vllm:lora_requests_info`. vLLM's own Prometheus logger writes the first four; two need the
gateway's knowledge:

- `vllm:num_requests_waiting`: the engine's queue plus the gateway's admission queue (every
  worker's), so that a router does not take a server that queues in front of its engine for an
  idle one. (`vllm:num_requests_waiting_by_reason` keeps the engine's numbers alone.) With one
  engine core, it, `vllm:num_requests_running` and `vllm:kv_cache_usage_perc` are read from the
  scheduler numbers all workers share (the engine's `_SchedulerSnapshot`): vLLM's own gauges are
  per worker, and a scrape could show one worker's older copy.
- `vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}` (value: the
  Unix time of the update, here the scrape, so a router takes the newest series): vLLM 0.32 fills
  both lists from the same set of adapters (vllm/v1/metrics/stats.py, `update_scheduler_stats`;
  llm-d-router #2605). Its series is dropped and ours written instead: running = adapters with
  requests executing in the engine, waiting = adapters with requests queued anywhere (the
  gateway's admission queue, or the engine's own queue: submitted and not scheduled yet, or
  preempted). One adapter can be in both.

Residency, in the shape vLLM's open proposal uses (vllm #54830; the names are ours until vLLM
settles them): `vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}` (1 per adapter the
engine holds: `gpu` while requests of it execute, so it holds one of `maxLoras` slots; `cpu`
loaded and idle), `vllm:num_gpu_loaded_lora_adapters`, `vllm:num_cpu_loaded_lora_adapters`,
`vllm:max_gpu_lora_adapters` (`maxLoras`), `vllm:max_cpu_lora_adapters` (`maxCpuLoras`) and
`vllm:lora_adapter_load_seconds` (every load of every adapter).

With several workers the answering worker adds the others' engine requests (asked through
`server.core.peers` at scrape time) and their admission queues (shared live gauges); the
adapter registry is the whole server's already. The queues are read once per scrape, and the
gateway's own queue families (`gateway_requests_queued`, `gateway_adapter_requests_queued`) show
that same reading: the other workers keep changing their files while a scrape merges them, and
one scrape must not say 2 queued in one family and 0 in `vllm:num_requests_waiting`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample

from server.core.adapters import LOAD_BUCKETS, AdapterSnapshot, Residency
from server.core.service import InferenceService
from server.core.types import AdapterLoad, EngineStats
from server.observability.exposition import Exposition

ENGINE_LOADS = "engine_adapter_loads"  # the peers' operation: a worker's requests per adapter
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
LORA_INFO = "vllm:lora_requests_info"
GATEWAY_QUEUED = "gateway_requests_queued"
GATEWAY_ADAPTER_QUEUED = "gateway_adapter_requests_queued"

QueueDepth = Callable[[], tuple[float, dict[str, float]]]  # all, and per adapter name


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """What the server holds now, over every worker."""

    queued: float  # requests in the gateway's admission queues
    queued_by_adapter: dict[str, float]
    scheduler: EngineStats  # the engine's latest numbers, as every worker shares them
    engine: dict[str, AdapterLoad]  # requests in the engine, per adapter
    adapters: Sequence[AdapterSnapshot]
    at: float  # Unix time

    def running_adapters(self) -> list[str]:
        return sorted(name for name, load in self.engine.items() if load.running > 0)

    def waiting_adapters(self) -> list[str]:
        known = {snap.name for snap in self.adapters}
        queued = {name for name, n in self.queued_by_adapter.items() if n > 0 and name in known}
        engine = {name for name, load in self.engine.items() if load.waiting > 0}
        return sorted(queued | engine)


class ModelServerContract:
    def __init__(self, service: InferenceService, queue_depth: QueueDepth) -> None:
        self._service = service
        self._queue_depth = queue_depth
        self._exposition = Exposition()
        service.peers.handle(ENGINE_LOADS, self._local_loads)

    async def _local_loads(self) -> dict[str, tuple[int, int]]:
        """This worker's engine requests per adapter (plain values: they cross processes)."""
        return {
            name: (load.running, load.waiting)
            for name, load in self._service.stats().adapters.items()
        }

    async def gather(self) -> ServerLoad:
        """The server's numbers now (the registry refreshed by the caller)."""
        engine: dict[str, list[int]] = {}
        for answer in [await self._local_loads(), *await self._service.peers.ask(ENGINE_LOADS)]:
            for name, (running, waiting) in (answer or {}).items():
                total = engine.setdefault(name, [0, 0])
                total[0] += running
                total[1] += waiting
        queued, by_adapter = self._queue_depth()
        return ServerLoad(
            queued=queued,
            queued_by_adapter=by_adapter,
            scheduler=self._service.stats(),
            engine={name: AdapterLoad(*numbers) for name, numbers in engine.items()},
            adapters=self._service.adapters.snapshots(),
            at=time.time(),
        )

    def text(self, registries: Sequence[CollectorRegistry], load: ServerLoad) -> bytes:
        """`/metrics`: every registry with vLLM's families corrected, then ours."""
        latest = self._exposition.latest
        parts = [latest(_Corrected(registry, load)) for registry in registries]
        limits = self._service.adapters.limits
        if limits.enabled:
            parts.append(latest(_Families(lora_families(
                load, max_loras=limits.max_loras, max_cpu_loras=limits.max_cpu_loras
            ))))
        return b"".join(parts)


class _Corrected:
    """A registry's families as `generate_latest` collects them, vLLM's corrected."""

    def __init__(self, registry: CollectorRegistry, load: ServerLoad) -> None:
        self._registry = registry
        self._load = load

    def collect(self) -> Iterator[Metric]:
        engine = self._load.scheduler
        used = 1.0 - engine.free_blocks / engine.total_blocks if engine.total_blocks else 0.0
        current = {
            WAITING: engine.waiting + self._load.queued,
            RUNNING: float(engine.running),
            KV_USAGE: used,
            GATEWAY_QUEUED: self._load.queued,
        }
        for family in self._registry.collect():
            if family.name == LORA_INFO:
                continue
            if family.name in current and len(family.samples) == 1:
                yield with_value(family, current[family.name])
            elif family.name == WAITING:
                yield with_gateway_queue(family, self._load.queued)
            elif family.name == GATEWAY_ADAPTER_QUEUED:
                yield with_adapter_queues(family, self._load.queued_by_adapter)
            else:
                yield family


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def with_value(family: Metric, value: float) -> Metric:
    """A one-series family set to the scrape's reading: a one-engine family to the numbers every
    worker shares (vLLM's own gauge is each worker's copy, merged as the most recently written:
    vLLM reports a step's numbers to one front end, so another worker's older copy can win), the
    gateway's queue to the one the contract counts."""
    (sample,) = family.samples
    return _revalued(family, [sample._replace(value=value)])


def with_adapter_queues(family: Metric, queued: dict[str, float]) -> Metric:
    """`gateway_adapter_requests_queued` (a series per registered adapter) set to the scrape's
    reading of the queues, the one `vllm:lora_requests_info` lists its waiting adapters from."""
    return _revalued(family, [
        sample._replace(value=queued.get(sample.labels.get("adapter", ""), 0.0))
        for sample in family.samples
    ])


def with_gateway_queue(family: Metric, queued: float) -> Metric:
    """`vllm:num_requests_waiting` plus the gateway's queue, added to the first engine's series
    (one series per engine core; the admission queue is in front of them all)."""
    samples = sorted(family.samples, key=lambda s: s.labels.get("engine", ""))
    return _revalued(family, [
        sample._replace(value=sample.value + (queued if index == 0 else 0.0))
        for index, sample in enumerate(samples)
    ])


def _revalued(family: Metric, samples: list[Sample]) -> Metric:
    out = Metric(family.name, family.documentation, family.type, family.unit)
    out.samples.extend(samples)
    return out


def lora_families(load: ServerLoad, *, max_loras: int, max_cpu_loras: int) -> list[Metric]:
    info = GaugeMetricFamily(
        LORA_INFO,
        "Running stats on lora requests: running = adapters with requests executing in the "
        "engine, waiting = adapters with requests queued (gateway or engine); the value is the "
        "Unix time of the update.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    info.add_metric(
        [str(max_loras), ",".join(load.waiting_adapters()), ",".join(load.running_adapters())],
        load.at,
    )
    return [info, *residency_families(load, max_loras=max_loras, max_cpu_loras=max_cpu_loras)]


def residency_families(
    load: ServerLoad, *, max_loras: int, max_cpu_loras: int
) -> list[Metric]:
    running = set(load.running_adapters())
    loaded = GaugeMetricFamily(
        "vllm:lora_adapter_loaded",
        "1 per adapter the engine holds: level gpu while requests of it execute (it holds a "
        "maxLoras slot), cpu loaded and idle (names after vllm #54830, ours until vLLM settles "
        "them).",
        labels=["adapter_name", "level", "pinned", "rank"],
    )
    counts = {"gpu": 0, "cpu": 0}
    for snap in load.adapters:
        if snap.residency is Residency.REGISTERED:
            continue
        level = "gpu" if snap.name in running else "cpu"
        counts[level] += 1
        loaded.add_metric([snap.name, level, str(snap.pinned).lower(), str(snap.rank)], 1.0)
    families: list[Metric] = [loaded]
    for level, count in counts.items():
        families.append(GaugeMetricFamily(
            f"vllm:num_{level}_loaded_lora_adapters", f"Adapters loaded at level {level}.",
            value=count,
        ))
    families.append(GaugeMetricFamily(
        "vllm:max_gpu_lora_adapters", "Adapters that can execute in one batch (maxLoras).",
        value=max_loras,
    ))
    families.append(GaugeMetricFamily(
        "vllm:max_cpu_lora_adapters", "Adapters the engine holds at once (maxCpuLoras).",
        value=max_cpu_loras,
    ))
    families.append(load_histogram(load.adapters))
    return families


def load_histogram(snapshots: Sequence[AdapterSnapshot]) -> Metric:
    family = HistogramMetricFamily(
        "vllm:lora_adapter_load_seconds", "Time to load an adapter into the engine (every load)."
    )
    cumulative = [0] * len(LOAD_BUCKETS)
    for snap in snapshots:
        for index, count in enumerate(snap.load_buckets):
            cumulative[index] += count
    buckets = [(repr(bound), float(n)) for bound, n in zip(LOAD_BUCKETS, cumulative, strict=True)]
    buckets.append(("+Inf", float(sum(snap.loads for snap in snapshots))))
    family.add_metric([], buckets, sum_value=sum(snap.load_seconds for snap in snapshots))
    return family
