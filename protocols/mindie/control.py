"""MindIE's control plane: its management routes on the management listener.

Routes (PROTOCOLS.md §5.1–5.2): `GET /stopService` (graceful drain, `?mode=Force` aborts),
`GET /v1/status` and `/v2/status`, `GET /v1/config`, `POST /v1/role/{prefill|decode|flex}` and
`/v2/role/{prefill|decode}`, `GET /health/timed[-{seconds}]` (a real one-token generation),
and the health family `/v2/health/live|ready`, `/v2/models/{m}/ready`, `/health`,
`/v2/models/{m}/getSlotCount`. Every answer reads the one `Lifecycle`; errors use MindIE's
envelope `{"error": message, "error_type": reason}`, which is also how the management and
metrics listeners answer paths no route serves (`UNROUTED`). What these routes need from the
server (stop, the configuration facts) comes through the context's `ServerPort`.

Liveness and readiness (RELIABILITY_PERF.md B.2): live is 200 while the process serves, even
while draining (a liveness failure would kill a draining pod), and 500 once the engine failed;
ready is 503 while draining, stopped or saturated (MindIE "busy"), 500 once the engine failed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from protocols.common.errors import ErrorTable
from protocols.mindie.probe import ProbeGate
from server.core.errors import GatewayError, PayloadTooLarge, ServiceUnavailable, Unauthorized
from server.core.lifecycle import Lifecycle, Role, Shutdown, State
from server.core.service import InferenceService
from server.http import jsonio
from server.http.body import json_response, retry_headers
from server.http.context import ConfigFacts, ServerPort
from server.http.routes import MANAGEMENT, Access, Answer, Doc, Route, RouteList, Unrouted

NAME = "control"
LIVE_PATHS = frozenset({"/v2/health/live"})  # answers 200 while the engine starts

REASONS = {
    400: "Bad Request",
    404: "NotFoundError",
    405: "Method Not Allowed",
    409: "Conflict",
    422: "Input Validation Error",
    500: "Incomplete Generation",
    503: "Service Unavailable",
}
STOPPED_MESSAGE = "The service has been stopped."
MAX_WAIT_S = 600  # /health/timed-{s}: 1..600, at most 3 digits (MindIE CheckWaitTime)
DEFAULT_WAIT_S = 10
ROLES_V1 = (Role.PREFILL, Role.DECODE, Role.FLEX)
ROLES_V2 = (Role.PREFILL, Role.DECODE)
ROLE_BODY_ERROR = "Req body converts to json fail. Reset to previous node status."
RETRY_AFTER_S = 5


def mindie_error(
    status: int,
    message: str,
    *,
    error_type: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body = {"error": message, "error_type": error_type or REASONS.get(status, "Bad Request")}
    return json_response(body, status, headers)


# (status, reason text), keyed by domain error class (closest in the MRO wins).
CONTROL_STATUS: ErrorTable[tuple[int, str]] = ErrorTable(
    {
        Unauthorized: (401, "Unauthorized"),
        PayloadTooLarge: (413, "Payload Too Large"),
        ServiceUnavailable: (503, "Service Unavailable"),  # the start-up answer
    },
    default=(400, "Bad Request"),
)


def render(exc: GatewayError) -> Response:
    """The control plane's (MindIE) envelope `{"error", "error_type"}` for a domain error."""
    status, reason = CONTROL_STATUS[exc]
    return mindie_error(status, exc.message, error_type=reason, headers=retry_headers(exc))


def not_found(scope: Scope) -> Response:
    return mindie_error(404, f"No route {scope['path']} on this listener.")


def method_not_allowed(allowed: tuple[str, ...]) -> Response:
    return mindie_error(405, "Method Not Allowed", headers={"Allow": ", ".join(allowed)})


UNROUTED = Unrouted(render=render, not_found=not_found, method_not_allowed=method_not_allowed)


def message(status: int, text: str) -> Response:
    """MindIE's health answers carry `{"message": ...}` rather than the error envelope."""
    return json_response({"message": text}, status)


def unavailable(lifecycle: Lifecycle) -> Response | None:
    """MindIE's guard in front of status routes: 503 once stopping or unhealthy, else None."""
    if lifecycle.state in (State.DRAINING, State.STOPPED):
        return mindie_error(503, STOPPED_MESSAGE, headers={"Retry-After": str(RETRY_AFTER_S)})
    if lifecycle.state is not State.READY:
        return Response(status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    return None


def abnormal(lifecycle: Lifecycle) -> str:
    reason = lifecycle.failure
    return f"Service is abnormal: {reason}" if reason else "Service is abnormal"


# ---- health -------------------------------------------------------------------------------
def live(service: InferenceService) -> Response:
    lifecycle = service.lifecycle
    if lifecycle.state is State.FAILED:
        return message(500, abnormal(lifecycle))
    if lifecycle.state is State.READY and service.admission.saturated:
        return message(200, "Service is alive but busy")
    return Response(status_code=200)


def ready(service: InferenceService) -> Response:
    lifecycle = service.lifecycle
    if lifecycle.state is State.FAILED:
        return message(500, abnormal(lifecycle))
    refusal = unavailable(lifecycle)
    if refusal is not None:
        return refusal
    if service.admission.saturated:
        return message(503, "Service is alive but busy. Consider reducing request frequency")
    return Response(status_code=200)


def model_health(service: InferenceService) -> Response:
    """`/health` and `/v2/models/{m}/ready` (MindIE HandleGetHealthStatus)."""
    lifecycle = service.lifecycle
    if lifecycle.state is State.FAILED:
        return mindie_error(500, abnormal(lifecycle))
    return unavailable(lifecycle) or Response(status_code=200)


def unknown_model(service: InferenceService, name: str) -> Response | None:
    if name in service.base_names:
        return None
    return mindie_error(404, f"Model {name} not found.")


def slot_count(service: InferenceService) -> dict[str, int]:
    """MindIE getSlotCount: engine batch slots and the tokens the free KV blocks can hold."""
    info, stats = service.info(), service.stats()
    return {
        "total_slots": info.max_num_seqs,
        "free_slots": max(0, info.max_num_seqs - stats.running),
        "available_tokens_length": stats.free_blocks * info.block_size,
    }


def health_routes(service: InferenceService, out: RouteList) -> None:
    """MindIE's health family on the management listener (on a port shared with the data
    listener, the protocols' own health shapes win: they declare overrides)."""

    async def v2_live(request: Request) -> Answer:
        return live(service)

    async def v2_ready(request: Request) -> Answer:
        return ready(service)

    async def health(request: Request) -> Answer:
        return model_health(service)

    async def model_ready(request: Request) -> Answer:
        return unknown_model(service, request.path_params["model"]) or model_health(service)

    async def get_slot_count(request: Request) -> Answer:
        refusal = unavailable(service.lifecycle) or unknown_model(
            service, request.path_params["model"]
        )
        return refusal or json_response(slot_count(service))

    probe = Access.OPEN
    versioned = "/v2/models/{model}/versions/{version}"
    out.get("/v2/health/live", v2_live, access=probe, doc=Doc(summary="Liveness (open)"))
    out.get("/v2/health/ready", v2_ready, access=probe, doc=Doc(summary="Readiness (open)"))
    out.get("/health", health, access=probe, doc=Doc(summary="Model health (open)"))
    for prefix in ("/v2/models/{model}", versioned):
        out.get(f"{prefix}/ready", model_ready, access=probe,
                doc=Doc(summary="Model readiness (open)"))
        out.get(f"{prefix}/getSlotCount", get_slot_count, access=Access.DATA,
                doc=Doc(summary="Free engine slots"))


# ---- /health/timed ------------------------------------------------------------------------
def parse_wait(raw: str | None) -> int | Response:
    """MindIE CheckWaitTime: absent → 10; else 1..600 with at most 3 digits; bad → 404."""
    if raw is None:
        return DEFAULT_WAIT_S
    if not raw.isdigit() or len(raw) > len(str(MAX_WAIT_S)):
        return mindie_error(404, f"Max wait time is {MAX_WAIT_S}, input is invalid or too long")
    seconds = int(raw)
    if not 1 <= seconds <= MAX_WAIT_S:
        return mindie_error(
            404, f"Wait time should be in range of [1, {MAX_WAIT_S}], input is not valid"
        )
    return seconds


def timed_health(service: InferenceService, out: RouteList) -> None:
    """`/health/timed[-{s}]`: open, so its probes go through one `ProbeGate` (one at a time, a
    fresh result reused) and cannot be used to load the engine."""
    gate = ProbeGate(service)

    async def endpoint(request: Request) -> Answer:
        state = service.lifecycle.state
        if state in (State.DRAINING, State.STOPPED):
            return json_response({"status": "healthy"})  # MindIE: healthy while stopping
        if state is not State.READY:
            return Response(status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        wait = parse_wait(request.path_params.get("seconds"))
        if isinstance(wait, Response):
            return wait
        result = await gate.check(wait)
        if result.failure is not None:
            return mindie_error(500, result.failure)
        return json_response({"status": "healthy"})

    doc = Doc(summary="One-token probe (open)")
    out.get("/health/timed", endpoint, access=Access.OPEN, doc=doc)
    out.get("/health/timed-{seconds}", endpoint, access=Access.OPEN, doc=doc)


# ---- status, config -----------------------------------------------------------------------
@dataclass(kw_only=True)
class RoleState:
    p_percentage: int | None = None  # flex only: share of prefill work (MindIE)


def status_body(service: InferenceService, roles: RoleState, *, v2: bool) -> dict[str, Any]:
    lifecycle = service.lifecycle
    stats = service.stats()
    slots = slot_count(service)
    role: dict[str, Any] = {"roleStatus": "RoleReady", "currentRole": lifecycle.role.value}
    if lifecycle.role is Role.FLEX and roles.p_percentage is not None:
        role["p_percentage"] = roles.p_percentage
    resource: dict[str, Any] = {
        "availSlotsNum": slots["free_slots"],
        "availBlockNum": stats.free_blocks,
        "waitingRequestNum": stats.waiting + service.admission.waiting,
        "runningRequestNum": stats.running,
        "swappedRequestNum": 0,
        "freeNpuBlockNums": stats.free_blocks,
        "freeCpuBlockNums": 0,
        "totalNpuBlockNums": stats.total_blocks,
        "totalCpuBlockNums": 0,
    }
    if v2:
        resource |= {
            "totalAvailNpuSlotsNum": slots["free_slots"],
            "totalAvailNpuBlockNum": stats.free_blocks,
            "dpInstMap": {"0": stats.free_blocks},
            "maxAvailNpuBlockNum": stats.free_blocks,
        }
    return {
        "service": role,
        "resource": resource,
        "linkStatus": {"peers": []},
        "gateway": {
            "state": lifecycle.state.value,
            "inflight": lifecycle.inflight,
            "admitted": service.admission.running,
            "queued": service.admission.waiting,
            "adapters": service.adapters.names(),
            "pid": os.getpid(),  # which worker answered, when several serve
        },
    }


def config_body(service: InferenceService, facts: ConfigFacts) -> dict[str, Any]:
    """MindIE's /v1/config fields, then the whole resolved configuration, secrets redacted."""
    info = service.info()
    return {
        "modelName": facts.model_name,
        "maxSeqLen": info.max_model_len,
        "npuMemSize": -1,
        "cpuMemSize": facts.kv_cache_gib,
        "worldSize": facts.world_size,
        "maxOutputLen": info.max_model_len,
        "cacheBlockSize": info.block_size,
        "settings": dict(facts.settings),
    }


# ---- role ---------------------------------------------------------------------------------
def parse_role(raw: str, allowed: tuple[Role, ...]) -> Role | Response:
    for role in allowed:
        if raw == role.value:
            return role
    names = ", ".join(r.value for r in allowed)
    return mindie_error(404, f"Role '{raw}' is not supported here; use one of: {names}.")


def topology_error(body: bytes, *, v2: bool) -> str | None:
    """Check the optional PD topology body; returns a reason when it is malformed."""
    if not body.strip():
        return None
    try:
        data = jsonio.loads(body)
    except jsonio.JSONDecodeError:
        return "not JSON"
    if not isinstance(data, dict):
        return "not a JSON object"
    local = data.get("local")
    share = local.get("p_percentage") if isinstance(local, dict) else None
    problems = [
        (local is not None and not isinstance(local, list if v2 else dict), "`local` shape"),
        (data.get("peers") is not None and not isinstance(data["peers"], list), "`peers` shape"),
        (share is not None and (type(share) is not int or not 0 <= share <= 100), "p_percentage"),
    ]
    return next((reason for bad, reason in problems if bad), None)


def role_routes(lifecycle: Lifecycle, roles: RoleState, out: RouteList) -> None:
    def switcher(allowed: tuple[Role, ...], *, v2: bool) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Answer:
            role = parse_role(request.path_params["role"], allowed)
            if isinstance(role, Response):
                return role
            body = await request.body()
            if topology_error(body, v2=v2) is not None:
                return mindie_error(422, ROLE_BODY_ERROR, error_type="Input validation error")
            if not lifecycle.switch_role(role):
                return mindie_error(
                    409, f"Cannot change the role while the service is {lifecycle.state.value}."
                )
            local = jsonio.loads(body).get("local") if body.strip() else None
            share = local.get("p_percentage") if isinstance(local, dict) else None
            roles.p_percentage = share if role is Role.FLEX else None
            return json_response({"result": "ok"})

        return endpoint

    out.post("/v1/role/{role}", switcher(ROLES_V1, v2=False),
             doc=Doc(summary="Switch role", body=ROLE_TOPOLOGY))
    out.post("/v2/role/{role}", switcher(ROLES_V2, v2=True),
             doc=Doc(summary="Switch role (v2)", body=ROLE_TOPOLOGY))


ROLE_TOPOLOGY: dict[str, Any] = {
    "type": "object",
    "properties": {"local": {}, "peers": {"type": "array"}},
}


# ---- stop ---------------------------------------------------------------------------------
def stop_routes(shutdown: Shutdown, out: RouteList) -> None:
    async def stop_service(request: Request) -> Answer:
        mode = request.query_params.get("mode")
        if mode not in (None, "Force"):
            return mindie_error(400, f"mode must be Force or absent, got '{mode}'")
        shutdown.request(force=mode == "Force")
        await shutdown.drained.wait()
        return Response(status_code=200)

    out.get("/stopService", stop_service,
            doc=Doc(summary="Graceful stop (`mode=Force` aborts)", query=("mode",)))


def routes(service: InferenceService, server: ServerPort) -> list[Route]:
    """The management listener's own routes: control plane (admin) and health family (open)."""
    out = RouteList(
        owner=NAME, render=render, listeners=frozenset({MANAGEMENT}), access=Access.ADMIN
    )
    roles = RoleState()

    async def status_v1(request: Request) -> Answer:
        return unavailable(service.lifecycle) or json_response(
            status_body(service, roles, v2=False)
        )

    async def status_v2(request: Request) -> Answer:
        return unavailable(service.lifecycle) or json_response(
            status_body(service, roles, v2=True)
        )

    async def config(request: Request) -> Answer:
        return json_response(config_body(service, server.config))

    stop_routes(server.shutdown, out)
    out.get("/v1/status", status_v1, doc=Doc(summary="Status"))
    out.get("/v2/status", status_v2, doc=Doc(summary="Status (v2)"))
    out.get("/v1/config", config, doc=Doc(summary="Configuration, secrets redacted"))
    role_routes(service.lifecycle, roles, out)
    timed_health(service, out)
    health_routes(service, out)
    return out.routes
