"""Assembly: settings + engine → service, registry, lifecycle → one ASGI app per listener.

Every protocol package exposes `routes.data_routes(ctx)` (inference and its own health/info
routes) and may expose `routes.management_routes(ctx)` (adapter management). Paths that several
protocols claim are dispatched here by the keys of the JSON body.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.routing import BaseRoute, Route

from protocols._common.context import ProtocolContext, RequestBounds
from protocols._common.replay import body_dispatch, has_key
from protocols.djl import routes as djl
from protocols.kserve_v2 import routes as kserve_v2
from protocols.mindie import routes as mindie
from protocols.openai_v1 import routes as openai_v1
from protocols.tgi import routes as tgi
from server import __version__
from server.core.adapter_files import AdapterRules, BaseModelShape
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.core.engine import Engine
from server.core.lifecycle import Lifecycle
from server.core.service import InferenceService, Limits, RequestObserver
from server.middleware import RequestIdMiddleware
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
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    extra_routes: dict[str, list[BaseRoute]] = field(default_factory=dict)

    def request_stop(self) -> None:
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
    model = settings.ModelConfig
    base_names = [
        model.modelName,
        *([info.model_name] if info.model_name != model.modelName else []),
    ]
    adapters = AdapterRegistry(
        engine=engine,
        rules=adapter_rules(settings, base_names),
        limits=(
            AdapterLimits(
                enabled=settings.LoraConfig.enabled,
                max_loras=settings.LoraConfig.maxLoras,
                max_cpu_loras=settings.LoraConfig.maxCpuLoras or settings.LoraConfig.maxLoras,
            )
        ),
    )
    service = InferenceService(
        engine=engine,
        adapters=adapters,
        lifecycle=lifecycle,
        limits=service_limits(settings),
        base_names=base_names,
        observer=observer,
    )
    context = ProtocolContext(
        service=service,
        max_body_bytes=settings.ServerConfig.maxRequestLength * 1024 * 1024,
        bounds=request_bounds(settings),
        server_version=__version__,
        created=int(time.time()),
        allow_runtime_lora=settings.LoraConfig.enabled and settings.LoraConfig.allowRuntimeUpdates,
    )
    return Gateway(
        settings=settings,
        engine=engine,
        lifecycle=lifecycle,
        adapters=adapters,
        service=service,
        context=context,
    )


def adapter_rules(settings: Settings, base_names: list[str]) -> AdapterRules:
    lora = settings.LoraConfig
    roots = [resolve_path(settings, r) for r in lora.adapterRoots]
    if lora.adapterDir:
        roots.append(resolve_path(settings, lora.adapterDir))
    model_path = resolve_path(settings, settings.ModelConfig.modelWeightPath)
    return AdapterRules(
        roots=tuple(roots),
        max_rank=lora.maxLoraRank,
        base_names=frozenset(base_names),
        base_shape=BaseModelShape.from_model_dir(model_path),
    )


def service_limits(settings: Settings) -> Limits:
    limits = settings.LimitsConfig
    return Limits(
        max_concurrent=limits.maxConcurrentRequests,
        max_queue=limits.maxQueue,
        queue_timeout_s=limits.queueTimeout,
        request_timeout_s=limits.requestTimeout,
    )


def request_bounds(settings: Settings) -> RequestBounds:
    limits = settings.LimitsConfig
    return RequestBounds(
        max_n=limits.maxN,
        max_best_of=limits.maxBestOf,
        max_stop_sequences=limits.maxStopSequences,
        max_logprobs=limits.maxLogprobs,
        max_prompts=limits.maxPromptsPerRequest,
    )


async def register_startup_adapters(gateway: Gateway) -> None:
    """Adapters from the `adapters/` folder and the config list. A bad one is logged, not fatal."""
    lora = gateway.settings.LoraConfig
    if not lora.enabled:
        return
    entries = startup_adapter_entries(gateway.settings)
    for name, src, preload, pin in entries:
        try:
            await gateway.adapters.register(name, src, preload=preload, pin=pin)
        except Exception as exc:  # one bad adapter must not stop the server
            logger.error("adapter %s from %s not registered: %s", name, src, exc)


def startup_adapter_entries(settings: Settings) -> list[tuple[str, str, bool, bool]]:
    """(name, src, preload, pin) for every sub-directory of adapterDir, then the config list."""
    lora = settings.LoraConfig
    entries: list[tuple[str, str, bool, bool]] = []
    if lora.adapterDir:
        folder = Path(resolve_path(settings, lora.adapterDir))
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
        [(has_key("prompt"), mindie.vllm_generate(ctx))], tgi.generate(ctx), max_bytes=limit
    )
    invocations = body_dispatch(
        [
            (has_key("messages"), openai_v1.chat_completions(ctx)),
            (has_key("prompt"), openai_v1.completions(ctx)),
        ],
        djl.invocations(ctx),
        max_bytes=limit,
    )
    tokenize = body_dispatch(
        [
            (has_key("prompt"), openai_v1.tokenize(ctx)),
            (has_key("messages"), openai_v1.tokenize(ctx)),
        ],
        tgi.tokenize(ctx),
        max_bytes=limit,
    )
    return [
        Route("/generate", generate, methods=["POST"]),
        Route("/invocations", invocations, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
    ]


RouteSource = Callable[[Gateway], list[BaseRoute]]


def data_routes(gateway: Gateway) -> list[BaseRoute]:
    ctx = gateway.context
    routes = shared_routes(ctx)
    for protocol in PROTOCOLS:
        routes += protocol.data_routes(ctx)
    return routes


def management_routes(gateway: Gateway) -> list[BaseRoute]:
    routes: list[BaseRoute] = list(gateway.extra_routes.get("management", []))
    for protocol in PROTOCOLS:
        build = getattr(protocol, "management_routes", None)
        if build is not None:
            routes += build(gateway.context)
    return routes


def metrics_routes(gateway: Gateway) -> list[BaseRoute]:
    return list(gateway.extra_routes.get("metrics", []))


ROLE_ROUTES: dict[str, RouteSource] = {
    "management": management_routes,
    "metrics": metrics_routes,
    "data": data_routes,
}


def listener_app(gateway: Gateway, roles: tuple[str, ...]) -> Starlette:
    """One Starlette app serving the routes of every role a listener has (control routes first)."""
    routes: list[BaseRoute] = []
    for role in ("management", "metrics", "data"):
        if role in roles:
            routes += ROLE_ROUTES[role](gateway)
    app = Starlette(routes=_dedupe(routes))
    app.add_middleware(RequestIdMiddleware)
    return app


def _dedupe(routes: list[BaseRoute]) -> list[BaseRoute]:
    seen: set[tuple[str, frozenset[str]]] = set()
    unique = []
    for route in routes:
        key = (getattr(route, "path", ""), frozenset(getattr(route, "methods", None) or ()))
        if key not in seen:
            seen.add(key)
            unique.append(route)
    return unique
