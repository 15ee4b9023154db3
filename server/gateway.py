"""Assembly: settings + engine → one `Gateway` whose parts are all built here, once.

The protocols come from `protocols.REGISTRY` (never by name): each spec's data routes, then
their management routes (a control plane, reaching the server through the context's
`ServerPort`), then the server's own (/openapi.json, /metrics) make every listener's routing
table; a listener app serves the routes of the roles it has (data, management, metrics; several
roles may share one address). Nothing here is changed after `build_gateway` returns.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

import protocols
from server import __version__
from server.control import openapi
from server.control.grpc_health import health_service
from server.core.adapter_files import AdapterRules, BaseModelShape, validate_adapter_dir
from server.core.adapter_prefetch import Prefetcher
from server.core.adapter_state import SavedAdapter, StateFileError, read_state
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.core.admission import Admission, Limits
from server.core.composition import Composition
from server.core.engine import Engine
from server.core.lifecycle import Lifecycle, Shutdown, State
from server.core.peers import Peers
from server.core.service import InferenceService
from server.core.stream import RequestObserver
from server.engines.lora_merge import NumpyComposer
from server.http.app import (
    Fallback,
    ListenerApp,
    fastapi_method_not_allowed,
    fastapi_not_found,
)
from server.http.auth import Keyring
from server.http.context import ConfigFacts, ProtocolContext, RequestBounds, ServerPort
from server.http.router import Router
from server.http.routes import DATA, LISTENERS, MANAGEMENT, Access, Route, Unrouted
from server.http.rpc import AccessInterceptor, GrpcService
from server.http.starting import PathOwner, StartingAnswers
from server.observability import metrics as metrics_routes
from server.observability.logs import RequestLog
from server.observability.metrics import GatewayMetrics, LiveState
from server.observability.shared import multiprocess_dir
from server.observability.sources import SourceMetrics
from server.settings import Settings, SettingsError, redacted, resolve_path
from server.sources.cache import AdapterCache
from server.sources.fetcher import RemoteSources
from server.sources.https import HttpsRemote
from server.sources.hub import HubRemote
from server.sources.remote import FetchObserver
from server.sources.s3 import S3Remote

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
    context: ProtocolContext  # what every protocol's routes, services and start-up see

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
            access_notes=self.settings.logging.access_log,
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
    shutdown: Shutdown | None = None,
    observer: RequestObserver | None = None,
    make_adapters: Callable[..., AdapterRegistry] = AdapterRegistry,
    peers: Peers | None = None,
) -> Gateway:
    """The gateway of this process. `make_adapters` makes its adapter registry and `peers`
    reaches the other workers when several processes serve (server/runtime/placement.py:
    the owner's registry publishes its changes, the others mirror it)."""
    shutdown = shutdown or Shutdown(Lifecycle(), drain_delay_s=settings.server.drain_delay)
    lifecycle = shutdown.lifecycle
    base_names = _base_names(settings, engine)
    state = settings.lora.state_file
    rules = adapter_rules(settings, base_names)
    shared = multiprocess_dir() is not None
    source_metrics = SourceMetrics(shared=shared)
    adapters = make_adapters(
        engine=engine, rules=rules, limits=_adapter_limits(settings),
        state_file=Path(resolve_path(settings, state)) if state else None,
        fetcher=adapter_fetcher(settings, rules, source_metrics),
        composition=Composition(
            NumpyComposer(), merged_adapter_dir(settings),
            max_entries=settings.lora.max_merged_adapters,
        ),
    )
    limits = service_limits(settings)
    admission = Admission(
        limits, prefetch=Prefetcher(adapters), resident=held_adapters_pass(settings, adapters)
    )
    registry = CollectorRegistry()
    metrics = GatewayMetrics(
        registry,
        protocols=[spec.name for spec in protocols.REGISTRY],
        live=LiveState(lifecycle, admission, adapters),
        # the access line carries each request's summary; per-generation lines are DEBUG
        request_log=RequestLog(log_prompts=settings.logging.log_prompts, level=logging.DEBUG),
        access_log=settings.logging.access_log,
        families=source_metrics.families,
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
        peers=peers,
    )
    registries = metrics.registries
    management = settings.server.management
    port = ServerPort(
        shutdown=shutdown,
        config=_config_facts(settings),
        latency=metrics.latency_windows,
        management_address=f"{management.host}:{management.port}",
    )
    context = protocol_context(settings, service, port)
    routes = _routes(settings, context, metrics)
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
        context=context,
    )


def _grpc_services(context: ProtocolContext) -> tuple[GrpcService, ...]:
    """Every protocol's gRPC services, then grpc.health.v1 answering for them."""
    built = [s for spec in protocols.REGISTRY if spec.grpc for s in spec.grpc(context)]
    return (*built, health_service(context.service.lifecycle))


def _routes(
    settings: Settings, context: ProtocolContext, metrics: GatewayMetrics
) -> tuple[Route, ...]:
    """Every protocol's data routes (the same context as their gRPC services), their
    management routes, then the server's own: /openapi.json and /metrics."""
    built: list[Route] = [r for spec in protocols.REGISTRY for r in spec.routes(context)]
    built += [r for spec in protocols.REGISTRY if spec.management for r in spec.management(context)]
    documents: dict[str, dict[str, Any]] = {}
    render = _unrouted().render
    built += openapi.routes(documents.get, render)
    built += metrics_routes.routes(
        context.service, metrics, registries=metrics.registries, render=render
    )
    for listener in LISTENERS:  # the documents describe the routes as built
        routes = [route for route in built if listener in route.listeners]
        documents[listener] = openapi.openapi_document(
            listener, routes, listener_url(settings, listener)
        )
    return tuple(built)


def live_paths() -> frozenset[str]:
    """GET paths that answer 200 while the engine starts: every liveness probe."""
    return frozenset(path for spec in protocols.REGISTRY for path in spec.live_paths)


def starting_answers(roles: tuple[str, ...]) -> StartingAnswers:
    """A listener's answers while the engine starts: on a data listener each protocol renders
    the 503 of the paths it owns; other paths get the management listeners' answer when the
    listener has that role, else the first protocol's."""
    specs = protocols.REGISTRY if DATA in roles else ()
    owners = [PathOwner(spec.paths, spec.render) for spec in specs]
    default = _unrouted().render if set(roles) - {DATA} else protocols.REGISTRY[0].render
    return StartingAnswers(owners, default=default, live=live_paths())


def _fallback(roles: tuple[str, ...]) -> Fallback:
    """What answers for paths no route serves: on a data listener as the first protocol and
    vLLM's (FastAPI's) `{"detail": ...}` 404 and 405 (clients of every protocol see the same
    answer); else the spec that declares how the management and metrics listeners answer
    (`unrouted`)."""
    if DATA in roles:
        return Fallback(
            render=protocols.REGISTRY[0].render,
            access=Access.DATA,
            not_found=fastapi_not_found,
            method_not_allowed=fastapi_method_not_allowed,
        )
    unrouted = _unrouted()
    return Fallback(
        render=unrouted.render,
        access=Access.ADMIN if MANAGEMENT in roles else Access.METRICS,
        not_found=unrouted.not_found,
        method_not_allowed=unrouted.method_not_allowed,
    )


def _unrouted() -> Unrouted:
    """The one spec's answer on the management and metrics listeners, else the data
    listener's."""
    declared = [spec.unrouted for spec in protocols.REGISTRY if spec.unrouted is not None]
    assert len(declared) <= 1, "one protocol answers for the management listeners"
    if declared:
        return declared[0]
    return Unrouted(
        render=protocols.REGISTRY[0].render,
        not_found=fastapi_not_found,
        method_not_allowed=fastapi_method_not_allowed,
    )


def protocol_context(
    settings: Settings, service: InferenceService, server: ServerPort | None = None
) -> ProtocolContext:
    lora = settings.lora
    return ProtocolContext(
        service=service,
        max_body_bytes=settings.server.max_request_bytes,
        bounds=request_bounds(settings),
        server_version=__version__,
        created=int(time.time()),
        allow_runtime_lora=lora.enabled and lora.allow_runtime_updates,
        options=protocol_options(settings),
        server=server,
    )


def protocol_options(settings: Settings) -> dict[str, Any]:
    """The settings protocols declare they read (`ProtocolSpec.options`), by field name: the
    protocols section, and the workflow files resolved."""
    options: dict[str, Any] = settings.protocols.model_dump()
    options["workflows"] = tuple(resolve_path(settings, w) for w in settings.lora.workflows)
    return options


def _config_facts(settings: Settings) -> ConfigFacts:
    model = settings.model
    return ConfigFacts(
        model_name=model.name,
        model_path=resolve_path(settings, model.weight_path),
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
    roots.append(str(adapter_cache_dir(settings)))
    roots.append(str(merged_adapter_dir(settings)))
    model_path = resolve_path(settings, settings.model.weight_path)
    return AdapterRules(
        roots=tuple(roots),
        max_rank=lora.max_lora_rank,
        base_names=frozenset(base_names) | frozenset(settings.model.aliases),
        base_shape=BaseModelShape.from_model_dir(model_path),
    )


def adapter_cache_dir(settings: Settings) -> Path:
    folder = settings.lora.adapter_cache_dir
    if folder is None:
        return Path(tempfile.gettempdir()) / f"llm-gateway-{os.getuid()}" / "adapter-cache"
    return Path(resolve_path(settings, folder))


def adapter_fetcher(
    settings: Settings, rules: AdapterRules, observer: FetchObserver | None = None
) -> RemoteSources:
    """The remote adapter sources and their cache (nothing is fetched before it is named)."""
    lora = settings.lora
    budget = int(lora.adapter_cache_gib * 2**30)
    ca_file = lora.adapter_source_ca_file
    return RemoteSources(
        remotes=[
            S3Remote(budget),
            HttpsRemote(budget, resolve_path(settings, ca_file) if ca_file else None),
            HubRemote(),
        ],
        cache=AdapterCache(adapter_cache_dir(settings), budget),
        check=lambda folder: validate_adapter_dir(folder, rules),
        timeout_s=lora.adapter_source_timeout_s,
        prefixes=lora.adapter_sources,
        observer=observer,
    )
def merged_adapter_dir(settings: Settings) -> Path:
    """Where composed adapters are cached: `mergedAdapterDir`, else `merged-adapters` next to
    the state file, else in the system's temporary folder (content-addressed and written
    atomically, so servers may share it)."""
    lora = settings.lora
    if lora.merged_adapter_dir:
        return Path(resolve_path(settings, lora.merged_adapter_dir))
    if lora.state_file:
        return Path(resolve_path(settings, lora.state_file)).parent / "merged-adapters"
    return Path(tempfile.gettempdir()) / f"llm-gateway-{os.getuid()}" / "merged-adapters"


def service_limits(settings: Settings) -> Limits:
    limits, lora = settings.limits, settings.lora
    active, cached = active_adapters(settings)
    return Limits(
        max_concurrent=limits.max_concurrent_requests,
        max_queue=limits.max_queue,
        fair=limits.fair_admission,
        queue_timeout_s=limits.queue_timeout_s,
        request_timeout_s=limits.request_timeout_s,
        adapter_slots=-(-active // settings.server.workers),
        cycle_s=lora.adapter_cycle_s,
        # the next adapters in line, in the cached places the active ones leave
        prefetch=max(0, min(active, cached - active)) if active else 0,
    )


def held_adapters_pass(settings: Settings, adapters: AdapterRegistry) -> Callable[[str], bool]:
    """Which adapters admission lets past full adapter slots: those the engine holds, when the
    slots stand for the engine's cached places (the default); none with fewer slots (then the
    point is that the engine never queues a request of an adapter beyond them)."""
    active, cached = active_adapters(settings)
    return adapters.is_resident if active >= cached else _never


def _never(name: str) -> bool:
    return False


def active_adapters(settings: Settings) -> tuple[int, int]:
    """Distinct adapters admitted at once (`maxActiveAdapters`, by default `maxCpuLoras`; 0: no
    limit) and the engine's cached places. With workers each admits its part, rounded up (with
    more workers than places the engine may hold one per worker and queue the rest itself)."""
    lora = settings.lora
    cached = lora.max_cpu_loras or lora.max_loras
    if not lora.enabled:
        return 0, cached
    return (cached if lora.max_active_adapters is None else lora.max_active_adapters), cached


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
    """Adapters from the `adapters/` folder and the config list, then the state file's runtime
    registrations, then each protocol's start-up (DJL's workflows). A bad one is logged, not
    fatal."""
    settings = gateway.settings
    if settings.lora.enabled:
        await _register_startup_adapters(gateway, settings, saved)
    for spec in protocols.REGISTRY:
        if spec.startup is not None:
            await spec.startup(gateway.context)


async def _register_startup_adapters(
    gateway: Gateway, settings: Settings, saved: Sequence[SavedAdapter]
) -> None:
    for name, src, preload, pin, origin in startup_adapter_entries(settings):
        try:
            await gateway.adapters.register(name, src, preload=preload, pin=pin, origin=origin)
        except Exception as exc:  # one bad adapter must not stop the server
            logger.error("adapter %s from %s not registered: %s", name, src, exc)
    for adapter in saved:
        try:  # as saved, so the state file has nothing new to write
            await gateway.adapters.register(
                adapter.name, adapter.src, preload=adapter.preload, pin=adapter.pin,
                options=adapter.options,
            )
        except Exception as exc:
            logger.error("adapter %s from %s (LoraConfig.stateFile) not registered, dropped "
                         "from the state file: %s", adapter.name, adapter.src, exc)
            await gateway.adapters.resave(adapter.name)


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
