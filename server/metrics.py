"""Metrics: `GatewayMetrics` (the service's `RequestObserver`), the HTTP middleware that counts
every response, and the metrics listener's routes (`/metrics`, `/metrics-json`).

`/metrics` is vLLM's own `vllm:` families (the engine registers them in prometheus_client's
default registry of this process) followed by the `gateway_*` families of the gateway registry.
Every label comes from a closed set: protocols from `PROTOCOLS`, endpoints from route templates,
error types from the domain errors, states and roles from their enums, status codes as numbers.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protocols._common.http import json_response
from server.core.adapters import AdapterRegistry, Residency
from server.core.errors import GatewayError
from server.core.lifecycle import Role, State
from server.core.service import InferenceService, Timing
from server.core.types import GenerationRequest, Usage

if TYPE_CHECKING:
    from server.logs import RequestLog

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
PROTOCOLS = ("openai", "tgi", "kserve", "mindie", "djl", "health", "control", "metrics", "other")
_ALIASES = {
    "openai_v1": "openai",
    "vllm": "openai",
    "sagemaker": "djl",
    "kserve_v2": "kserve",
    "triton": "kserve",
    "kserve-v2": "kserve",
    "probe": "health",
}
# Set by endpoints that know their protocol better than their route (body-dispatched paths).
SCOPE_PROTOCOL = "gateway.protocol"
UNMATCHED = "unmatched"  # endpoint label of a request no route matched

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

access_logger = logging.getLogger("gateway.access")


_KNOWN = frozenset(PROTOCOLS)


def protocol_label(name: str) -> str:
    """The closed-set protocol label of a protocol or package name."""
    label = _ALIASES.get(name, name)
    return label if label in _KNOWN else "other"


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


class GatewayMetrics:
    """Declares every `gateway_*` metric in `registry` and observes the service.

    Per generated token the cost is one dict lookup and one histogram observation.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        window: int = 1000,
        request_log: RequestLog | None = None,
    ) -> None:
        self.registry = registry
        self.request_log = request_log
        self.ttft_window = MovingAverage(window)
        self.tbt_window = MovingAverage(window)
        self._error_types = error_types()
        self._declare(registry)

    def _declare(self, registry: CollectorRegistry) -> None:
        proto = ("protocol",)
        self.http_requests = Counter(
            "gateway_http_requests",
            "HTTP responses by protocol, route template and status.",
            ("protocol", "endpoint", "status"),
            registry=registry,
        )
        self.generations = Counter(
            "gateway_generation_requests",
            "Generation requests admitted to the engine.",
            proto,
            registry=registry,
        )
        self.failures = Counter(
            "gateway_request_failures",
            "Generation requests refused or failed, by error type.",
            ("protocol", "error_type"),
            registry=registry,
        )
        self.inflight = Gauge(
            "gateway_requests_inflight",
            "Generation requests running in the engine now.",
            proto,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "gateway_prompt_tokens",
            "Prompt tokens of finished requests.",
            proto,
            registry=registry,
        )
        self.generation_tokens = Counter(
            "gateway_generation_tokens",
            "Generated tokens of finished requests.",
            proto,
            registry=registry,
        )
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "Admission to the first generated token.",
            proto,
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "gateway_inter_token_latency_seconds",
            "Time between two generated tokens.",
            proto,
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "gateway_e2e_request_latency_seconds",
            "Admission to the end of the response.",
            proto,
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self._ttft = {p: self.ttft.labels(p) for p in PROTOCOLS}
        self._itl = {p: self.itl.labels(p) for p in PROTOCOLS}
        self._e2e = {p: self.e2e.labels(p) for p in PROTOCOLS}
        self._inflight = {p: self.inflight.labels(p) for p in PROTOCOLS}
        for p in PROTOCOLS:  # every series exists from the start, so rates work from zero
            self.generations.labels(p)
            self.prompt_tokens.labels(p)
            self.generation_tokens.labels(p)

    def bind(self, service: InferenceService) -> None:
        """Export the service's live state (lifecycle, role, queue, adapters) on each scrape."""
        self.registry.register(LiveStateCollector(service))
        self.registry.register(AdapterCollector(service.adapters))

    # ---- RequestObserver -----------------------------------------------------------------
    def admitted(self, request: GenerationRequest) -> None:
        label = protocol_label(request.protocol)
        self.generations.labels(label).inc()
        self._inflight[label].inc()
        if self.request_log is not None:
            self.request_log.admitted(request)

    def first_token(self, request: GenerationRequest, seconds: float) -> None:
        self._ttft[protocol_label(request.protocol)].observe(seconds)

    def token_gap(self, request: GenerationRequest, seconds: float) -> None:
        self._itl[protocol_label(request.protocol)].observe(seconds)

    def finished(
        self,
        request: GenerationRequest,
        *,
        error_type: str | None,
        usage: Usage | None,
        timing: Timing,
    ) -> None:
        label = protocol_label(request.protocol)
        self._inflight[label].dec()
        self._e2e[label].observe(timing.seconds)
        if usage is not None:
            self.prompt_tokens.labels(label).inc(usage.prompt_tokens)
            self.generation_tokens.labels(label).inc(usage.completion_tokens)
        if error_type is not None:
            self._fail(label, error_type)
        if timing.first_token_s is not None:
            self.ttft_window.add(timing.first_token_s)
        if timing.mean_token_gap_s is not None:
            self.tbt_window.add(timing.mean_token_gap_s)
        if self.request_log is not None:
            self.request_log.finished(request, error_type=error_type, usage=usage, timing=timing)

    def rejected(self, request: GenerationRequest, error_type: str) -> None:
        self._fail(protocol_label(request.protocol), error_type)
        if self.request_log is not None:
            self.request_log.rejected(request, error_type)

    def _fail(self, label: str, error_type: str) -> None:
        known = error_type if error_type in self._error_types else "other"
        self.failures.labels(label, known).inc()

    # ---- HTTP ----------------------------------------------------------------------------
    def http_response(self, protocol: str, endpoint: str, status: int) -> None:
        self.http_requests.labels(protocol, endpoint, str(status)).inc()


class LiveStateCollector(Collector):
    """Gauges read from the service at scrape time: nothing to keep in sync."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service

    def collect(self) -> Iterable[Metric]:
        service = self._service
        lifecycle = service.lifecycle
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
        yield GaugeMetricFamily(
            "gateway_requests_queued",
            "Requests waiting for an admission slot.",
            value=service.admission.waiting,
        )
        yield GaugeMetricFamily(
            "gateway_adapters_loaded",
            "LoRA adapters registered.",
            value=len(service.adapters.names()),
        )


class AdapterCollector(Collector):
    """Per-adapter series read from the registry at scrape time. The `adapter` label takes only
    names of registered adapters (the registry's records), never raw request input."""

    _COUNTERS = (
        ("requests", "gateway_adapter_requests", "Generation requests run on the adapter."),
        ("generated_tokens", "gateway_adapter_generation_tokens", "Tokens generated with it."),
        ("loads", "gateway_adapter_loads", "Times the adapter was loaded into the engine."),
        ("evictions", "gateway_adapter_evictions", "Times it was evicted from the engine."),
        ("load_failures", "gateway_adapter_load_failures", "Loads the engine refused."),
    )

    def __init__(self, adapters: AdapterRegistry) -> None:
        self._adapters = adapters

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
        pinned = GaugeMetricFamily("gateway_adapter_pinned", "1 if pinned.", labels=["adapter"])
        residency = GaugeMetricFamily(
            "gateway_adapter_residency",
            "1 for where the adapter is: engine_slot (requests running), cpu_cache (loaded, "
            "idle) or registered (not loaded).",
            labels=["adapter", "residency"],
        )
        for snap in snapshots:
            inflight.add_metric([snap.name], float(snap.inflight))
            pinned.add_metric([snap.name], 1.0 if snap.pinned else 0.0)
            for place in Residency:
                residency.add_metric([snap.name, place.value], float(snap.residency is place))
        yield inflight
        yield pinned
        yield residency


class HttpMetricsMiddleware:
    """Counts every HTTP response by protocol, route template and status; writes the access log.

    Pure ASGI (never buffers a stream). The endpoint label is the matched route's template,
    never the raw path; the protocol comes from the route's owner (`owners`: id(route) → label),
    or from the endpoint when a shared path was dispatched by its body.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: GatewayMetrics,
        owners: Mapping[int, str],
        access_log: bool = False,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.owners = owners
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # if the app dies before answering, the server answers 500

        async def observe_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observe_status)
        finally:
            self._record(scope, status, time.perf_counter() - started)

    def _record(self, scope: Scope, status: int, seconds: float) -> None:
        route: BaseRoute | None = scope.get("route")
        endpoint = getattr(route, "path", UNMATCHED) if route is not None else UNMATCHED
        owner = self.owners.get(id(route), "other") if route is not None else "other"
        protocol = scope.get(SCOPE_PROTOCOL) or owner
        self.metrics.http_response(protocol, endpoint, status)
        if self.access_log:
            access_logger.info(
                "%s %s %d %s %.1fms",
                scope.get("method"),
                scope.get("path"),
                status,
                protocol,
                seconds * 1000,
            )


def prometheus_text(registries: Sequence[CollectorRegistry]) -> bytes:
    return b"".join(generate_latest(registry) for registry in registries)


def metrics_json(service: InferenceService, metrics: GatewayMetrics, instance: str) -> object:
    """MindIE's /metrics-json: TTFT and TBT means (integer ms) over the last 1000 requests,
    waiting and processing requests, free KV blocks; values are strings, `metric` a list."""
    stats = service.engine.stats()
    values = {
        "TTFT": round(metrics.ttft_window.mean * 1000),
        "TBT": round(metrics.tbt_window.mean * 1000),
        "waitingInferRequestNum": stats.waiting + service.admission.waiting,
        "processingInferRequestNum": stats.running,
        "remainBlocks": stats.free_blocks,
    }
    return {
        "resultType": "vector",
        "result": [
            {
                "metric": [{"__name__": name, "job": "node", "instance": instance}],
                "value": str(value),
            }
            for name, value in values.items()
        ],
    }


Guard = Callable[[], Response | None]


def metrics_routes(
    service: InferenceService,
    metrics: GatewayMetrics,
    *,
    registries: Sequence[CollectorRegistry],
    instance: str,
    guard: Guard,
) -> list[BaseRoute]:
    """`/metrics` (always served) and `/metrics-json` (MindIE: 503 once stopping or unhealthy;
    `guard` returns that response or None)."""

    async def prometheus(request: Request) -> Response:
        return Response(prometheus_text(registries), media_type=PROMETHEUS_TEXT)

    async def mindie_json(request: Request) -> Response:
        refusal = guard()
        if refusal is not None:
            return refusal
        return json_response(metrics_json(service, metrics, instance))

    return [
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/metrics-json", mindie_json, methods=["GET"]),
    ]
