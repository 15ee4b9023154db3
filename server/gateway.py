"""Assembly: settings + engine → service, registry, lifecycle, metrics → one ASGI app per listener.

Every protocol package exposes `routes.data_routes(ctx)` (inference and its own health/info
routes) and may expose `routes.management_routes(ctx)` (adapter management). Paths that several
protocols claim are dispatched here by the keys of the JSON body. The management listener adds
the control router (server/control.py), the metrics listener `/metrics` and `/metrics-json`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from protocols._common.context import ProtocolContext, RequestBounds
from protocols._common.guard import Endpoint
from protocols._common.replay import body_dispatch, has_key
from protocols.djl import routes as djl
from protocols.kserve_v2 import routes as kserve_v2
from protocols.mindie import routes as mindie
from protocols.openai_v1 import routes as openai_v1
from protocols.tgi import routes as tgi
from server import __version__, control, workflows
from server.core.adapter_files import AdapterRules, BaseModelShape
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.core.engine import Engine
from server.core.lifecycle import Lifecycle
from server.core.service import InferenceService, Limits, RequestObserver
from server.logs import RequestLog
from server.metrics import (
    SCOPE_PROTOCOL,
    GatewayMetrics,
    HttpMetricsMiddleware,
    protocol_label,
)
from server.metrics import (
    metrics_routes as metrics_endpoints,
)
from server.middleware import RequestIdMiddleware
from server.openapi import openapi_routes
from server.security import protect, route_table
from server.settings import Settings, resolve_path

logger = logging.getLogger("gateway")
PROTOCOLS = (openai_v1, tgi, kserve_v2, mindie, djl)


@dataclass(kw_only=True)
class Gateway:
    settings: Settings
    engine: Engine
    lifecycle: Lifecycle
    adapters: AdapterRegistry
    service: InferenceService
    context: ProtocolContext
    metrics: GatewayMetrics
    registries: tuple[CollectorRegistry, ...]  # /metrics: the engine's (vllm:) first, then ours
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    force_requested: asyncio.Event = field(default_factory=asyncio.Event)
    drained: asyncio.Event = field(default_factory=asyncio.Event)

    def request_stop(self, *, force: bool = False) -> None:
        """SIGTERM, SIGINT and GET /stopService all land here. Readiness turns 503 at once;
        the runtime then drains (server/runtime.py `drain`) and sets `drained`. Force aborts
        in-flight requests now instead of waiting for them. Calling it again is harmless."""
        self.lifecycle.begin_drain()
        if force:
            self.force_requested.set()
        self.stop_requested.set()


def build_gateway(
    settings: Settings,
    engine: Engine,
    *,
    lifecycle: Lifecycle | None = None,
    observer: RequestObserver | None = None,
) -> Gateway:
    lifecycle = lifecycle or Lifecycle()
    info = engine.info()
    model = settings.model
    base_names = [
        model.name,
        *([info.model_name] if info.model_name != model.name else []),
    ]
    adapters = AdapterRegistry(
        engine=engine,
        rules=adapter_rules(settings, base_names),
        limits=(
            AdapterLimits(
                enabled=settings.lora.enabled,
                max_loras=settings.lora.max_loras,
                max_cpu_loras=settings.lora.max_cpu_loras or settings.lora.max_loras,
            )
        ),
    )
    registry = CollectorRegistry()
    logging_settings = settings.logging
    metrics = GatewayMetrics(
        registry,
        request_log=RequestLog(
            log_prompts=logging_settings.log_prompts,
            level=logging.INFO if logging_settings.access_log else logging.DEBUG,
        ),
    )
    service = InferenceService(
        engine=engine,
        adapters=adapters,
        lifecycle=lifecycle,
        limits=service_limits(settings),
        base_names=base_names,
        observer=observer or metrics,
    )
    metrics.bind(service)
    context = ProtocolContext(
        service=service,
        max_body_bytes=settings.server.max_request_bytes,
        bounds=request_bounds(settings),
        server_version=__version__,
        created=int(time.time()),
        allow_runtime_lora=settings.lora.enabled and settings.lora.allow_runtime_updates,
    )
    return Gateway(
        settings=settings,
        engine=engine,
        lifecycle=lifecycle,
        adapters=adapters,
        service=service,
        context=context,
        metrics=metrics,
        registries=(REGISTRY, registry),
    )


def adapter_rules(settings: Settings, base_names: list[str]) -> AdapterRules:
    lora = settings.lora
    roots = [resolve_path(settings, r) for r in lora.adapter_roots]
    roots += [str(folder) for folder in adapter_folders(settings)]
    model_path = resolve_path(settings, settings.model.weight_path)
    return AdapterRules(
        roots=tuple(roots),
        max_rank=lora.max_lora_rank,
        base_names=frozenset(base_names),
        base_shape=BaseModelShape.from_model_dir(model_path),
    )


def service_limits(settings: Settings) -> Limits:
    limits = settings.limits
    return Limits(
        max_concurrent=limits.max_concurrent_requests,
        max_queue=limits.max_queue,
        queue_timeout_s=limits.queue_timeout_s,
        request_timeout_s=limits.request_timeout_s,
    )


def request_bounds(settings: Settings) -> RequestBounds:
    limits = settings.limits
    return RequestBounds(
        max_n=limits.max_n,
        max_best_of=limits.max_best_of,
        max_stop_sequences=limits.max_stop_sequences,
        max_logprobs=limits.max_logprobs,
        max_prompts=limits.max_prompts_per_request,
    )


async def register_startup_adapters(gateway: Gateway) -> None:
    """Adapters from the `adapters/` folder and the config list. A bad one is logged, not fatal."""
    lora = gateway.settings.lora
    if not lora.enabled:
        return
    entries = startup_adapter_entries(gateway.settings)
    for name, src, preload, pin in entries:
        try:
            await gateway.adapters.register(name, src, preload=preload, pin=pin)
        except Exception as exc:  # one bad adapter must not stop the server
            logger.error("adapter %s from %s not registered: %s", name, src, exc)
    settings = gateway.settings
    base = workflows.ServedBase(
        names=gateway.service.base_names,
        path=resolve_path(settings, settings.model.weight_path),
    )
    specs = workflows.load_workflows([resolve_path(settings, w) for w in lora.workflows], base)
    await workflows.register_workflows(gateway.adapters, specs)


def adapter_folders(settings: Settings) -> list[Path]:
    """Folders whose sub-directories are adapters registered at start: `adapter_dir` and, as in
    DJL, the `adapters/` folder inside the model directory."""
    lora = settings.lora
    folders = [Path(resolve_path(settings, lora.adapter_dir))] if lora.adapter_dir else []
    beside = Path(resolve_path(settings, settings.model.weight_path)) / "adapters"
    if beside.is_dir() and all(beside.resolve() != f.resolve() for f in folders):
        folders.append(beside)
    return folders


def startup_adapter_entries(settings: Settings) -> list[tuple[str, str, bool, bool]]:
    """(name, src, preload, pin) for every sub-directory of adapter_dir, then the config list."""
    lora = settings.lora
    entries: list[tuple[str, str, bool, bool]] = []
    for folder in adapter_folders(settings):
        if folder.is_dir():
            entries += [
                (d.name, str(d), True, False) for d in sorted(folder.iterdir()) if d.is_dir()
            ]
    entries += [(a.name, resolve_path(settings, a.path), a.preload, a.pin) for a in lora.adapters]
    return entries


def shared_routes(ctx: ProtocolContext) -> list[BaseRoute]:
    """Paths several protocols claim, dispatched by body keys."""
    limit = ctx.max_body_bytes
    generate = body_dispatch(
        [(has_key("prompt"), tagged("mindie", mindie.vllm_generate(ctx)))],
        tagged("tgi", tgi.generate(ctx)),
        max_bytes=limit,
    )
    invocations = body_dispatch(
        [
            (has_key("messages"), tagged("openai", openai_v1.chat_completions(ctx))),
            (has_key("prompt"), tagged("openai", openai_v1.completions(ctx))),
        ],
        tagged("djl", djl.invocations(ctx)),
        max_bytes=limit,
    )
    tokenize = body_dispatch(
        [
            (has_key("prompt"), tagged("openai", openai_v1.tokenize(ctx))),
            (has_key("messages"), tagged("openai", openai_v1.tokenize(ctx))),
        ],
        tagged("tgi", tgi.tokenize(ctx)),
        max_bytes=limit,
    )
    return [
        Route("/generate", generate, methods=["POST"]),
        Route("/invocations", invocations, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
    ]


def tagged(protocol: str, endpoint: Endpoint) -> Endpoint:
    """Name the protocol a body-dispatched request went to, for the HTTP metrics."""

    async def run(request: Request) -> Response:
        request.scope[SCOPE_PROTOCOL] = protocol
        return await endpoint(request)

    return run


RouteGroup = tuple[str, list[BaseRoute]]  # (protocol label for the metrics, routes)
RouteSource = Callable[[Gateway], list[RouteGroup]]


def _label(protocol: object) -> str:
    return protocol_label(getattr(protocol, "__name__", "").split(".")[-2:][0])


def data_routes(gateway: Gateway) -> list[RouteGroup]:
    ctx = gateway.context
    groups: list[RouteGroup] = [("other", shared_routes(ctx))]  # `tagged` names the protocol
    for protocol in PROTOCOLS:
        groups.append((_label(protocol), protocol.data_routes(ctx)))
    return [*groups, *adapter_management_routes(gateway)]


def adapter_management_routes(gateway: Gateway) -> list[RouteGroup]:
    """vLLM's /v1/load_lora_adapter and DJL's /models/{m}/adapters. Their clients call them on
    the inference port (vLLM, DJL default), so they are on the data listener too; `adminKeys`
    guards them there as on the management listener."""
    groups: list[RouteGroup] = []
    for protocol in PROTOCOLS:
        build = getattr(protocol, "management_routes", None)
        if build is not None:
            groups.append((_label(protocol), build(gateway.context)))
    return groups


def management_routes(gateway: Gateway) -> list[RouteGroup]:
    groups: list[RouteGroup] = [
        ("control", [*control.control_routes(gateway), *openapi_routes(gateway.settings)])
    ]
    # MindIE serves /metrics* on the management listener too
    return [*groups, *adapter_management_routes(gateway), *metrics_routes(gateway)]


def metrics_routes(gateway: Gateway) -> list[RouteGroup]:
    management = gateway.settings.server.management
    instance = f"{management.host}:{management.port}"
    lifecycle = gateway.lifecycle
    routes = metrics_endpoints(
        gateway.service,
        gateway.metrics,
        registries=gateway.registries,
        instance=instance,
        guard=lambda: control.unavailable(lifecycle),
    )
    return [("metrics", routes)]


def health_routes(gateway: Gateway) -> list[RouteGroup]:
    return [("control", control.health_routes(gateway))]


# Route order on a listener: control first; MindIE's health family last, so that on a port
# shared with the data plane each protocol's own health shape wins.
LISTENER_ROUTES: tuple[tuple[str, RouteSource], ...] = (
    ("management", management_routes),
    ("metrics", metrics_routes),
    ("data", data_routes),
    ("management", health_routes),
)


def listener_app(gateway: Gateway, roles: tuple[str, ...]) -> Starlette:
    """One Starlette app serving the routes of every role a listener has."""
    groups = [g for role, source in LISTENER_ROUTES if role in roles for g in source(gateway)]
    owners = {id(route): label for label, routes in groups for route in routes}
    handlers = None if "data" in roles else control.EXCEPTION_HANDLERS
    app = Starlette(
        routes=_dedupe([route for _, routes in groups for route in routes]),
        exception_handlers=handlers,
    )
    table = route_table(groups, roles=roles, admin_paths=admin_paths(gateway))
    protect(app, table=table, settings=gateway.settings)  # auth, body limit: inside the metrics
    app.add_middleware(
        HttpMetricsMiddleware,
        metrics=gateway.metrics,
        owners=owners,
        access_log=gateway.settings.logging.access_log,
    )
    app.add_middleware(control.DrainMiddleware, lifecycle=gateway.lifecycle)
    app.add_middleware(RequestIdMiddleware)
    return app


def admin_paths(gateway: Gateway) -> frozenset[str]:
    """Path templates of the control plane and adapter management, on whichever listener."""
    return frozenset(
        getattr(route, "path", "")
        for label, routes in management_routes(gateway)
        if label != "metrics"
        for route in routes
    )


def _dedupe(routes: list[BaseRoute]) -> list[BaseRoute]:
    seen: set[tuple[str, frozenset[str]]] = set()
    unique = []
    for route in routes:
        key = (getattr(route, "path", ""), frozenset(getattr(route, "methods", None) or ()))
        if key not in seen:
            seen.add(key)
            unique.append(route)
    return unique
