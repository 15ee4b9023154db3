"""Assembly: settings + engine → one `Gateway` whose parts are all built here, once.

The protocols come from `protocols.REGISTRY` (never by name): each spec's routes, plus the
control plane's and the metrics routes, make every listener's routing table; a listener app
serves the routes of the roles it has (data, management, metrics; several roles may share one
address). Nothing here is changed after `build_gateway` returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.responses import PlainTextResponse, Response
from starlette.types import Scope

import protocols
from server import __version__
from server.control import openapi
from server.control import routes as control
from server.control.grpc_health import health_service
from server.core import workflows
from server.core.adapter_files import AdapterRules, BaseModelShape
from server.core.adapter_state import SavedAdapter, StateFileError, read_state
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.core.admission import Admission, Limits
from server.core.engine import Engine
from server.core.lifecycle import Lifecycle, Shutdown, State
from server.core.service import InferenceService
from server.core.stream import RequestObserver
from server.http.app import Fallback, ListenerApp
from server.http.auth import Keyring
from server.http.context import ProtocolContext, RequestBounds
from server.http.router import Router
from server.http.routes import DATA, LISTENERS, MANAGEMENT, Access, Route
from server.http.rpc import AccessInterceptor, GrpcService
from server.observability import metrics as metrics_routes
from server.observability.logs import RequestLog
from server.observability.metrics import GatewayMetrics, LiveState
from server.settings import Settings, SettingsError, redacted, resolve_path

logger = logging.getLogger("gateway")


@dataclass(frozen=True, slots=True, kw_only=True)
class Gateway:
    settings: Settings
    engine: Engine
    lifecycle: Lifecycle
    shutdown: Shutdown
    adapters: AdapterRegistry
    service: InferenceService
    metrics: GatewayMetrics
    routes: tuple[Route, ...]  # every route of every listener
    grpc_services: tuple[GrpcService, ...]  # the gRPC listener's services, health last
    registries: tuple[CollectorRegistry, ...]  # /metrics: GatewayMetrics.registries

    def app(self, roles: tuple[str, ...]) -> ListenerApp:
        """The app of a listener serving `roles` (one address may serve several)."""
        served = [route for route in self.routes if route.listeners & set(roles)]
        max_body = self.settings.server.max_request_bytes
        security = self.settings.security
        lifecycle = self.lifecycle
        return ListenerApp(
            Router(served, max_body_bytes=max_body),
            _fallback(roles),
            max_body_bytes=max_body,
            keyring=Keyring(security.api_keys, security.admin_keys),
            observer=self.metrics,
            closing=lambda: lifecycle.state is not State.READY,
        )

    def grpc_interceptor(
        self, peer_allowed: Callable[[bytes], bool] | None = None
    ) -> AccessInterceptor:
        """Bearer keys, revoked client certificates and metrics for every gRPC call (health
        probes need no key)."""
        security = self.settings.security
        return AccessInterceptor(
            Keyring(security.api_keys, security.admin_keys), self.grpc_services, self.metrics,
            peer_allowed,
        )


def build_gateway(
    settings: Settings,
    engine: Engine,
    *,
    lifecycle: Lifecycle | None = None,
    shutdown: Shutdown | None = None,
    observer: RequestObserver | None = None,
    make_adapters: Callable[..., AdapterRegistry] = AdapterRegistry,
) -> Gateway:
    """The gateway of this process; `make_adapters` makes its adapter registry (another
    worker's mirror, server/runtime/worker_link.py, when several processes serve)."""
    lifecycle = lifecycle or Lifecycle()
    shutdown = shutdown or Shutdown(lifecycle, drain_delay_s=settings.server.drain_delay)
    base_names = _base_names(settings, engine)
    state = settings.lora.state_file
    adapters = make_adapters(
        engine=engine, rules=adapter_rules(settings, base_names), limits=_adapter_limits(settings),
        state_file=Path(resolve_path(settings, state)) if state else None,
    )
    limits = service_limits(settings)
    admission = Admission(limits)
    registry = CollectorRegistry()
    metrics = GatewayMetrics(
        registry,
        protocols=[spec.name for spec in protocols.REGISTRY],
        live=LiveState(lifecycle, admission, adapters),
        # the access line carries each request's summary; per-generation lines are DEBUG
        request_log=RequestLog(log_prompts=settings.logging.log_prompts, level=logging.DEBUG),
        access_log=settings.logging.access_log,
    )
    service = InferenceService(
        engine=engine,
        adapters=adapters,
        lifecycle=lifecycle,
        admission=admission,
        limits=limits,
        base_names=base_names,
        aliases=settings.model.aliases,
        observer=observer or metrics,
    )
    registries = metrics.registries
    context = protocol_context(settings, service)
    routes = _routes(settings, context, metrics, registries, shutdown)
    return Gateway(
        settings=settings,
        engine=engine,
        lifecycle=lifecycle,
        shutdown=shutdown,
        adapters=adapters,
        service=service,
        metrics=metrics,
        routes=routes,
        grpc_services=_grpc_services(context),
        registries=registries,
    )


def _grpc_services(context: ProtocolContext) -> tuple[GrpcService, ...]:
    """Every protocol's gRPC services, then grpc.health.v1 answering for them."""
    built = [s for spec in protocols.REGISTRY if spec.grpc for s in spec.grpc(context)]
    return (*built, health_service(context.service.lifecycle))


def _routes(
    settings: Settings,
    context: ProtocolContext,
    metrics: GatewayMetrics,
    registries: tuple[CollectorRegistry, ...],
    shutdown: Shutdown,
) -> tuple[Route, ...]:
    """Every protocol's routes (the same context as their gRPC services), the control plane's
    and the metrics routes."""
    service = context.service
    built: list[Route] = [r for spec in protocols.REGISTRY for r in spec.routes(context)]
    documents: dict[str, dict[str, Any]] = {}
    built += control.routes(
        control.ControlContext(
            service=service,
            config=_config_facts(settings),
            shutdown=shutdown,
            openapi=documents.get,
        )
    )
    management = settings.server.management
    built += metrics_routes.routes(
        service,
        metrics,
        registries=registries,
        instance=f"{management.host}:{management.port}",
        guard=lambda: control.unavailable(service.lifecycle),
        render=control.render,
    )
    for listener in LISTENERS:  # the documents describe the routes as built
        routes = [route for route in built if listener in route.listeners]
        documents[listener] = openapi.openapi_document(
            listener, routes, listener_url(settings, listener)
        )
    return tuple(built)


def live_paths() -> frozenset[str]:
    """GET paths that answer 200 while the engine starts: every liveness probe."""
    specs = frozenset(path for spec in protocols.REGISTRY for path in spec.live_paths)
    return specs | control.LIVE_PATHS


def _fallback(roles: tuple[str, ...]) -> Fallback:
    """What answers for paths no route serves: on a data listener as the first protocol and
    Starlette's plain texts (as before: clients of every protocol see the same 404); else the
    control plane's envelope."""
    if DATA in roles:
        return Fallback(
            render=protocols.REGISTRY[0].render,
            access=Access.DATA,
            not_found=_plain_not_found,
            method_not_allowed=_plain_method_not_allowed,
        )
    return Fallback(
        render=control.render,
        access=Access.ADMIN if MANAGEMENT in roles else Access.METRICS,
        not_found=control.not_found,
        method_not_allowed=control.method_not_allowed,
    )


def _plain_not_found(scope: Scope) -> Response:
    return PlainTextResponse("Not Found", status_code=404)


def _plain_method_not_allowed(allowed: tuple[str, ...]) -> Response:
    return PlainTextResponse(
        "Method Not Allowed", status_code=405, headers={"Allow": ", ".join(allowed)}
    )


def protocol_context(settings: Settings, service: InferenceService) -> ProtocolContext:
    lora = settings.lora
    return ProtocolContext(
        service=service,
        max_body_bytes=settings.server.max_request_bytes,
        bounds=request_bounds(settings),
        server_version=__version__,
        created=int(time.time()),
        allow_runtime_lora=lora.enabled and lora.allow_runtime_updates,
        lmi_rolling_batch=settings.protocols.rolling_batch != "auto",
        tgi_compat=settings.protocols.tgi_compat,
    )


def _config_facts(settings: Settings) -> control.ConfigFacts:
    model = settings.model
    return control.ConfigFacts(
        model_name=model.name,
        kv_cache_gib=model.kv_cache_space_gib,
        world_size=model.tensor_parallel_size * model.pipeline_parallel_size,
        settings=redacted(settings),
    )


def listener_url(settings: Settings, listener: str) -> str:
    spec = getattr(settings.server, listener)
    scheme = "https" if spec.tls.enabled else "http"
    return f"{scheme}://{spec.host}:{spec.port}"


def _base_names(settings: Settings, engine: Engine) -> list[str]:
    served = settings.model.name
    engine_name = engine.info().model_name
    return [served, *([engine_name] if engine_name != served else [])]


def _adapter_limits(settings: Settings) -> AdapterLimits:
    lora = settings.lora
    return AdapterLimits(
        enabled=lora.enabled,
        max_loras=lora.max_loras,
        max_cpu_loras=lora.max_cpu_loras or lora.max_loras,
        discovery_dirs=tuple(str(folder) for folder in adapter_folders(settings)),
        on_demand=lora.on_demand,
    )


def adapter_rules(settings: Settings, base_names: list[str]) -> AdapterRules:
    lora = settings.lora
    roots = [resolve_path(settings, r) for r in lora.adapter_roots]
    roots += [str(folder) for folder in adapter_folders(settings)]
    model_path = resolve_path(settings, settings.model.weight_path)
    return AdapterRules(
        roots=tuple(roots),
        max_rank=lora.max_lora_rank,
        base_names=frozenset(base_names) | frozenset(settings.model.aliases),
        base_shape=BaseModelShape.from_model_dir(model_path),
    )


def service_limits(settings: Settings) -> Limits:
    limits = settings.limits
    return Limits(
        max_concurrent=limits.max_concurrent_requests,
        max_queue=limits.max_queue,
        fair=limits.fair_admission,
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


async def register_startup_adapters(
    gateway: Gateway, saved: Sequence[SavedAdapter] = ()
) -> None:
    """Adapters from the `adapters/` folder and the config list, the DJL workflows, then the
    state file's runtime registrations. A bad one is logged, not fatal."""
    settings = gateway.settings
    lora = settings.lora
    if not lora.enabled:
        return
    entries = startup_adapter_entries(settings)
    entries += [(a.name, a.src, a.preload, a.pin, "api") for a in saved]
    for name, src, preload, pin, origin in entries:
        try:
            await gateway.adapters.register(name, src, preload=preload, pin=pin, origin=origin)
        except Exception as exc:  # one bad adapter must not stop the server
            logger.error("adapter %s from %s not registered: %s", name, src, exc)
    base = workflows.ServedBase(
        names=gateway.service.base_names,
        path=resolve_path(settings, settings.model.weight_path),
    )
    specs = workflows.load_workflows([resolve_path(settings, w) for w in lora.workflows], base)
    await workflows.register_workflows(gateway.adapters, specs)


def saved_adapters(settings: Settings) -> list[SavedAdapter]:
    """The state file's registrations, read before the engine starts: a damaged file stops
    the start with a SettingsError naming it."""
    state = settings.lora.state_file
    if not state or not settings.lora.enabled:
        return []
    try:
        return read_state(Path(resolve_path(settings, state)))
    except StateFileError as exc:
        raise SettingsError(str(exc)) from None


def adapter_folders(settings: Settings) -> list[Path]:
    """Folders whose sub-directories are adapters registered at start: `adapterDir` and, as in
    DJL, the `adapters/` folder inside the model directory."""
    lora = settings.lora
    folders = [Path(resolve_path(settings, lora.adapter_dir))] if lora.adapter_dir else []
    beside = Path(resolve_path(settings, settings.model.weight_path)) / "adapters"
    if beside.is_dir() and all(beside.resolve() != f.resolve() for f in folders):
        folders.append(beside)
    return folders


def startup_adapter_entries(settings: Settings) -> list[tuple[str, str, bool, bool, str]]:
    """(name, src, preload, pin, origin) for every sub-directory of adapterDir (the first
    folder wins a name two have), then the config list."""
    entries: list[tuple[str, str, bool, bool, str]] = []
    seen: set[str] = set()
    for folder in adapter_folders(settings):
        if not folder.is_dir():
            continue
        for found in sorted(d for d in folder.iterdir() if d.is_dir()):
            if found.name in seen:
                logger.warning("adapter folder %s skipped: %s came first", found, found.name)
                continue
            seen.add(found.name)
            entries.append((found.name, str(found), True, False, "folder"))
    entries += [
        (a.name, resolve_path(settings, a.path), a.preload, a.pin, "config")
        for a in settings.lora.adapters
    ]
    return entries
