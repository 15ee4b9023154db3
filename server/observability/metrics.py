"""Metrics: `GatewayMetrics` (the service's `RequestObserver` and the listener apps'
`HttpObserver`, and the latency windows a protocol's metrics route reads), and `/metrics`.

`/metrics` is vLLM's own `vllm:` families (the engine registers them in prometheus_client's
default registry of this process) followed by the `gateway_*` families of the gateway registry.
Every label comes from a closed set: protocols from the registry's spec names (plus `health`,
`control`, `metrics`, `other`), endpoints from route templates, error types from the domain
errors, states and roles from their enums, status codes as numbers.

With several worker processes (server/observability/shared.py) every worker writes its `vllm:`
and `gateway_*` counters, histograms and live gauges to the shared files and the one answering
merges them all: in-flight and queued requests are `livesum` gauges (each worker's own, summed;
an ended worker's dropped), queues kept current by an admission watcher. Read at scrape time
from the answering worker alone: the lifecycle state and role (one series each, never summed)
and the adapters (the registry is the whole server's).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from server.core.adapters import LOAD_BUCKETS, AdapterRegistry, AdapterSnapshot, Residency
from server.core.admission import Admission
from server.core.errors import GatewayError
from server.core.lifecycle import Lifecycle, Role, State
from server.core.service import InferenceService
from server.core.stream import Timing
from server.core.types import GenerationRequest, Usage
from server.http.context import LatencyWindows, access_note_var
from server.http.routes import MANAGEMENT, METRICS, Access, Answer, Doc, Render, Route, RouteList
from server.observability.families import (
    Counter,
    Gauge,
    Histogram,
    SeriesLabels,
    Value,
    add_histogram,
)
from server.observability.logs import RequestLog, access_line
from server.observability.model_server import (
    GATEWAY_ADAPTER_QUEUED,
    GATEWAY_QUEUED,
    ModelServerContract,
)
from server.observability.shared import INTERNAL, SharedFiles, live_sums, multiprocess_dir
from server.observability.shared import worker_exited as worker_exited  # the supervisor's hook

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
BUILT_IN = ("health", "control", "metrics", "other")  # labels of the gateway's own requests
NAME = "metrics"
QUEUED = GATEWAY_QUEUED
QUEUED_DOC = "Requests waiting for an admission slot."
# Internal livesum gauges of multiprocess mode (never exposed): per-adapter queued slots, and
# the sum and length of each worker's MindIE windows.
ADAPTER_QUEUED = INTERNAL + "adapter_queued"
WINDOWS = INTERNAL + "windows"

# vLLM's buckets (vllm/v1/metrics/loggers.py), so the two families can be compared.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# admission queue wait per adapter: a grant at once, a slot's turn, a few cycles (cycle: 2 s)
ADAPTER_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)

access_logger = logging.getLogger("gateway.access")


def error_types() -> frozenset[str]:
    """Every `error_type` a domain error can carry, plus the service's "aborted"."""
    found: set[str] = {"aborted"}
    pending: list[type[GatewayError]] = [GatewayError]
    while pending:
        cls = pending.pop()
        found.add(cls.error_type)
        pending.extend(cls.__subclasses__())
    return frozenset(found)


class MovingAverage:
    """Mean of the last `size` values, O(1) per update (MindIE's TTFT/TBT window)."""

    def __init__(self, size: int) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self._sum = 0.0

    def add(self, value: float) -> None:
        if len(self._values) == self._values.maxlen:
            self._sum -= self._values[0]
        self._values.append(value)
        self._sum += value

    @property
    def mean(self) -> float:
        return self._sum / len(self._values) if self._values else 0.0

    def __len__(self) -> int:
        return len(self._values)


class SharedWindow(MovingAverage):
    """A `MovingAverage` whose sum and length are also live gauges, so that any worker can pool
    every worker's window."""

    def __init__(self, size: int, total: Value, count: Value) -> None:
        super().__init__(size)
        self._total = total
        self._count = count

    def add(self, value: float) -> None:
        super().add(value)
        self._total.value = self._sum
        self._count.value = len(self._values)


class GatewayMetrics:
    """Declares every `gateway_*` metric in `registry` and observes requests and responses.

    Per streamed delta the cost is one dict lookup and one histogram observation; per HTTP
    response one cached counter child.
    """

    def __init__(  # noqa: PLR0913 - the registry, what it reads, and optional parts
        self,
        registry: CollectorRegistry,
        *,
        protocols: Sequence[str],
        live: LiveState,
        window: int = 1000,
        request_log: RequestLog | None = None,
        access_log: bool = False,
        families: Sequence[Counter | Gauge | Histogram] = (),  # others' (adapter sources)
    ) -> None:
        self.registry = registry
        self.request_log = request_log
        self.access_log = access_log
        self.shared_dir = multiprocess_dir()
        self._live = live
        self._labels = frozenset((*protocols, *BUILT_IN))
        self._error_types = error_types()
        self._responses: dict[tuple[str, str, int], Value] = {}
        self._declare(registry, families)
        self.ttft_window: MovingAverage
        self.tbt_window: MovingAverage
        self.registries: tuple[CollectorRegistry, ...]  # /metrics
        if self.shared_dir is None:
            self.ttft_window = MovingAverage(window)
            self.tbt_window = MovingAverage(window)
            # the engine's families (vllm:, in prometheus_client's default registry), then ours
            self.registries = (REGISTRY, registry)
        else:
            self._share(registry, self.shared_dir, window)
        live.admission.watch(self)
        registry.register(LiveStateCollector(live, queued=self.shared_dir is None))
        registry.register(AdapterCollector(live.adapters, live.admission, self.shared_dir))

    def label(self, protocol: str) -> str:
        """The closed-set label of a request's protocol."""
        return protocol if protocol in self._labels else "other"

    def _declare(
        self, registry: CollectorRegistry, others: Sequence[Counter | Gauge | Histogram]
    ) -> None:
        """The families; with workers in the shared files (merged at scrape), else in
        `registry`."""
        proto = ("protocol",)
        shared = self.shared_dir is not None
        self.http_requests = Counter(
            "gateway_http_requests",
            "HTTP responses by protocol, route template and status.",
            ("protocol", "endpoint", "status"),
            shared=shared,
        )
        self.grpc_requests = Counter(
            "gateway_grpc_requests",
            "gRPC calls by protocol (or service), method and status code.",
            ("protocol", "method", "code"),
            shared=shared,
        )
        self.generations = Counter(
            "gateway_generation_requests",
            "Generation requests admitted to the engine.",
            proto,
            shared=shared,
        )
        self.failures = Counter(
            "gateway_request_failures",
            "Generation requests refused or failed, by error type.",
            ("protocol", "error_type"),
            shared=shared,
        )
        self.inflight = Gauge(
            "gateway_requests_inflight",
            "Generation requests running in the engine now.",
            proto,
            shared=shared,
            mode="livesum",  # each worker's own requests; an ended worker's are gone
        )
        self.prompt_tokens = Counter(
            "gateway_prompt_tokens",
            "Prompt tokens of finished requests.",
            proto,
            shared=shared,
        )
        self.generation_tokens = Counter(
            "gateway_generation_tokens",
            "Generated tokens of finished requests.",
            proto,
            shared=shared,
        )
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "Admission to the first generated token.",
            proto,
            TTFT_BUCKETS,
            shared=shared,
        )
        self.itl = Histogram(
            "gateway_inter_token_latency_seconds",
            "Time between two generated tokens.",
            proto,
            ITL_BUCKETS,
            shared=shared,
        )
        self.e2e = Histogram(
            "gateway_e2e_request_latency_seconds",
            "Admission to the end of the response.",
            proto,
            E2E_BUCKETS,
            shared=shared,
        )
        self.adapter_wait = Histogram(
            "gateway_adapter_queue_wait_seconds",
            "Time a request on the adapter waited in the admission queue (0 when admitted at "
            "once).",
            ("adapter",),
            ADAPTER_WAIT_BUCKETS,
            shared=shared,
        )
        self.adapter_rotations = Counter(
            "gateway_adapter_rotations",
            "Times the adapter waited for one of the adapter slots (LoraConfig."
            "maxActiveAdapters) and took it.",
            ("adapter",),
            shared=shared,
        )
        self.families: list[Counter | Gauge | Histogram] = [
            self.http_requests, self.grpc_requests, self.generations, self.failures, self.inflight,
            self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
            self.adapter_wait, self.adapter_rotations, *others,
        ]
        if not shared:
            for family in self.families:
                registry.register(family)
        self._series = {label: _Series(self, label) for label in sorted(self._labels)}

    def _share(self, registry: CollectorRegistry, path: str, window: int) -> None:
        """Multiprocess mode: /metrics is every worker's files merged, then the scrape-time
        collectors; what those read from this process alone today (queued requests, MindIE's
        windows) goes to live gauges every worker keeps current."""
        queued = Gauge(QUEUED, QUEUED_DOC, (), shared=True)
        self._queued = queued.labels()
        self._adapter_queued = Gauge(
            ADAPTER_QUEUED, "Slots waiting, per adapter.", ("adapter",), shared=True
        )
        windows = Gauge(WINDOWS, "MindIE window sums and lengths.", ("series",), shared=True)
        self.ttft_window = SharedWindow(
            window, windows.labels("ttft_sum"), windows.labels("ttft_count")
        )
        self.tbt_window = SharedWindow(
            window, windows.labels("tbt_sum"), windows.labels("tbt_count")
        )
        registry.register(SharedFiles(path, [*self.families, queued]))
        self.registries = (registry,)

    # ---- AdmissionWatcher ----------------------------------------------------------------
    def queue_changed(self, key: str, slots: int) -> None:
        """With workers, the live gauges: the total, and the queue of a key that is (or was) an
        adapter (an unknown model name gets no series). Without, scrapes read admission."""
        if self.shared_dir is None:
            return
        self._queued.value = self._live.admission.waiting
        series = self._adapter_queued.series.get((key,))
        if series is None:
            if key not in self._live.adapters:
                return
            series = self._adapter_queued.labels(key)
        series.value = slots

    def adapter_waited(self, key: str, seconds: float) -> None:
        if key in self._live.adapters:  # registered names only: never raw request input
            self.adapter_wait.labels(key).observe(seconds)

    def adapter_rotated(self, key: str) -> None:
        if key in self._live.adapters:
            self.adapter_rotations.labels(key).inc()

    def queue_depth(self) -> tuple[float, dict[str, float]]:
        """Requests waiting for admission (every worker's): all, and per queue key."""
        if self.shared_dir is None:
            admission = self._live.admission
            return float(admission.waiting), {k: float(n) for k, n in admission.queued().items()}
        sums = live_sums(self.shared_dir)
        by_key = {labels[0]: n for labels, n in sums.get(ADAPTER_QUEUED, {}).items()}
        return sums.get(QUEUED, {}).get((), 0.0), by_key

    def latency_windows(self) -> LatencyWindows:
        """The means over the last `window` requests and the queued slots: this process's; with
        workers every live worker's, the windows pooled (each worker's last requests together)."""
        if self.shared_dir is None:
            return LatencyWindows(
                self.ttft_window.mean, self.tbt_window.mean, self._live.admission.waiting
            )
        sums = live_sums(self.shared_dir)
        windows = sums.get(WINDOWS, {})

        def mean(name: str) -> float:
            count = windows.get((f"{name}_count",), 0.0)
            return windows.get((f"{name}_sum",), 0.0) / count if count else 0.0

        return LatencyWindows(mean("ttft"), mean("tbt"), int(sums.get(QUEUED, {}).get((), 0)))

    # ---- RequestObserver -----------------------------------------------------------------
    def _of(self, request: GenerationRequest) -> _Series:
        return self._series.get(request.protocol) or self._series["other"]

    def admitted(self, request: GenerationRequest) -> None:
        series = self._of(request)
        series.admitted.value += 1
        series.inflight.value += 1
        if self.request_log is not None:
            self.request_log.admitted(request)

    def first_token(self, request: GenerationRequest, seconds: float) -> None:
        self._of(request).ttft.observe(seconds)

    def token_gaps(self, request: GenerationRequest, gaps: Sequence[float]) -> None:
        self._of(request).itl.observe_each(gaps)

    def finished(
        self,
        request: GenerationRequest,
        *,
        error_type: str | None,
        usage: Usage | None,
        timing: Timing,
    ) -> None:
        series = self._of(request)
        series.inflight.value -= 1
        series.e2e.observe(timing.seconds)
        if usage is not None:
            series.prompt_tokens.value += usage.prompt_tokens
            series.generation_tokens.value += usage.completion_tokens
        if error_type is not None:
            self._fail(series.label, error_type)
        if timing.first_token_s is not None:
            self.ttft_window.add(timing.first_token_s)
        if timing.mean_token_gap_s is not None:
            self.tbt_window.add(timing.mean_token_gap_s)
        note = access_note_var.get() if self.access_log else None
        if note is not None:
            note.add(
                request.adapter,
                usage.prompt_tokens if usage else 0,
                usage.completion_tokens if usage else 0,
                timing.first_token_s,
            )
        if self.request_log is not None:
            self.request_log.finished(request, error_type=error_type, usage=usage, timing=timing)

    def rejected(self, request: GenerationRequest, error_type: str) -> None:
        self._fail(self.label(request.protocol), error_type)
        if self.request_log is not None:
            self.request_log.rejected(request, error_type)

    def _fail(self, label: str, error_type: str) -> None:
        known = error_type if error_type in self._error_types else "other"
        self.failures.labels(label, known).inc()

    # ---- HttpObserver ----------------------------------------------------------------------
    def response(
        self, scope: Scope, owner: str, endpoint: str, status: int, seconds: float
    ) -> None:
        key = (owner, endpoint, status)
        count = self._responses.get(key)
        if count is None:
            count = self._responses[key] = self.http_requests.labels(
                self.label(owner), endpoint, str(status)
            )
        count.value += 1
        if self.access_log:
            access_logger.info(
                "%s", access_line(scope, owner, endpoint, status, seconds, access_note_var.get())
            )


    # ---- RpcObserver -----------------------------------------------------------------------
    def rpc(self, owner: str, method: str, code: str, seconds: float) -> None:
        self.grpc_requests.labels(owner, method, code).value += 1
        if self.access_log:
            access_logger.info("gRPC %s %s %s %.1fms", owner, method, code, seconds * 1000)


class _Series:
    """One protocol's request metrics, looked up once (a dict hit per event, no `labels()`)."""

    __slots__ = (
        "admitted", "e2e", "generation_tokens", "inflight", "itl", "label", "prompt_tokens", "ttft",
    )

    def __init__(self, metrics: GatewayMetrics, label: str) -> None:
        self.label = label
        self.admitted = metrics.generations.labels(label)
        self.prompt_tokens = metrics.prompt_tokens.labels(label)
        self.generation_tokens = metrics.generation_tokens.labels(label)
        self.inflight = metrics.inflight.labels(label)
        self.ttft = metrics.ttft.labels(label)
        self.itl = metrics.itl.labels(label)
        self.e2e = metrics.e2e.labels(label)


class LiveState:
    """What the gateway's live gauges read at scrape time."""

    def __init__(self, lifecycle: Lifecycle, admission: Admission, adapters: AdapterRegistry):
        self.lifecycle = lifecycle
        self.admission = admission
        self.adapters = adapters


class LiveStateCollector(Collector):
    """Gauges read at scrape time: nothing to keep in sync. With workers, the answering worker's
    state and role (once, not per worker) and the adapters; `queued` comes from every worker's
    live gauges instead."""

    def __init__(self, live: LiveState, *, queued: bool = True) -> None:
        self._live = live
        self._queued = queued

    def collect(self) -> Iterable[Metric]:
        lifecycle = self._live.lifecycle
        state = GaugeMetricFamily(
            "gateway_lifecycle_state", "1 for the current lifecycle state.", labels=["state"]
        )
        for value in State:
            state.add_metric([value.value], 1.0 if lifecycle.state is value else 0.0)
        role = GaugeMetricFamily("gateway_role", "1 for the current MindIE role.", labels=["role"])
        for name in Role:
            role.add_metric([name.value], 1.0 if lifecycle.role is name else 0.0)
        yield state
        yield role
        if self._queued:
            yield GaugeMetricFamily(QUEUED, QUEUED_DOC, value=self._live.admission.waiting)
        yield GaugeMetricFamily(
            "gateway_adapters_loaded",
            "LoRA adapters registered.",
            value=len(self._live.adapters.names()),
        )


class AdapterCollector(Collector):
    """Per-adapter series read from the registry (and the admission queue) at scrape time. The
    `adapter` label takes only names of registered adapters (the registry's records), never raw
    request input. With workers, the queued slots per adapter are every worker's (the internal
    live gauge), the rest is the registry's."""

    _COUNTERS = (
        ("requests", "gateway_adapter_requests", "Generation requests run on the adapter."),
        ("generated_tokens", "gateway_adapter_generation_tokens", "Tokens generated with it."),
        ("loads", "gateway_adapter_loads", "Times the adapter was loaded into the engine."),
        ("cold_loads", "gateway_adapter_cold_loads",
         "Loads a request waited for (the adapter was not in the engine when it arrived)."),
        ("prefetches", "gateway_adapter_prefetches",
         "Loads started ahead of the adapter's turn in the admission queue."),
        ("evictions", "gateway_adapter_evictions", "Times it was evicted from the engine."),
        ("load_failures", "gateway_adapter_load_failures", "Loads the engine refused."),
    )

    def __init__(
        self, adapters: AdapterRegistry, admission: Admission, shared_dir: str | None = None
    ) -> None:
        self._adapters = adapters
        self._admission = admission
        self._shared_dir = shared_dir
        self._load_labels: dict[tuple[str, int], SeriesLabels] = {}

    def collect(self) -> Iterable[Metric]:
        snapshots = self._adapters.snapshots()
        for attr, name, doc in self._COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["adapter"])
            for snap in snapshots:
                family.add_metric([snap.name], float(getattr(snap, attr)))
            yield family
        inflight = GaugeMetricFamily(
            "gateway_adapter_requests_inflight", "Requests running on the adapter now.",
            labels=["adapter"],
        )
        queued = GaugeMetricFamily(
            GATEWAY_ADAPTER_QUEUED, "Requests waiting for an admission slot.",
            labels=["adapter"],
        )
        waiting = self._queued()
        pinned = GaugeMetricFamily("gateway_adapter_pinned", "1 if pinned.", labels=["adapter"])
        residency = GaugeMetricFamily(
            "gateway_adapter_residency",
            "1 for where the adapter is: engine_slot (requests running), cpu_cache (loaded, "
            "idle) or registered (not loaded).",
            labels=["adapter", "residency"],
        )
        for snap in snapshots:
            inflight.add_metric([snap.name], float(snap.inflight))
            queued.add_metric([snap.name], float(waiting.get(snap.name, 0)))
            pinned.add_metric([snap.name], 1.0 if snap.pinned else 0.0)
            for place in Residency:
                residency.add_metric([snap.name, place.value], float(snap.residency is place))
        yield inflight
        yield queued
        yield pinned
        yield residency
        yield _load_histogram(snapshots, self._load_labels)

    def _queued(self) -> dict[str, float]:
        if self._shared_dir is None:
            return dict(self._admission.queued())
        shared = live_sums(self._shared_dir).get(ADAPTER_QUEUED, {})
        return {labels[0]: value for labels, value in shared.items()}


def _load_histogram(
    snapshots: Sequence[AdapterSnapshot], labels_of: dict[tuple[str, int], SeriesLabels]
) -> Metric:
    family = HistogramMetricFamily(
        "gateway_adapter_load_seconds",
        "Time to load the adapter into the engine (file checks and the engine's add).",
        labels=["adapter"],
    )
    if len(labels_of) > 2 * len(snapshots) + 64:  # adapters removed since: forget their labels
        labels_of.clear()
    for snap in snapshots:
        counts = snap.load_buckets[: len(LOAD_BUCKETS)]
        key = (snap.name, len(counts))
        labels = labels_of.get(key)
        if labels is None:
            edges = [*(repr(bound) for bound in LOAD_BUCKETS[: len(counts)]), "+Inf"]
            labels = labels_of[key] = SeriesLabels(("adapter",), (snap.name,), edges)
        add_histogram(family, labels, [*map(float, counts), float(snap.loads)], snap.load_seconds)
    return family




def routes(
    service: InferenceService,
    metrics: GatewayMetrics,
    *,
    registries: Sequence[CollectorRegistry],
    render: Render,
) -> list[Route]:
    """`/metrics` (always served), on the metrics and management listeners."""

    contract = ModelServerContract(service, metrics.queue_depth)

    async def prometheus(request: Request) -> Answer:
        await service.adapters.refresh()
        load = await contract.gather()
        return Response(contract.text(registries, load), media_type=PROMETHEUS_TEXT)

    out = RouteList(
        owner=NAME, render=render, access=Access.METRICS,
        listeners=frozenset({MANAGEMENT, METRICS}),
    )
    out.get("/metrics", prometheus, doc=Doc(summary="Prometheus text (vllm: and gateway_)"))
    return out.routes
