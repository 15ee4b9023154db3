"""Who may call which route: the access class of every route, and bearer credentials.

Classes (`Access`):
- OPEN: the health and readiness family (`/health`, `/v2/health/live|ready`, `/ping`, `GET /`,
  `/v2/models/{m}[/versions/{v}]/ready`, `/health/timed[-{s}]`). Load balancers and kubelets
  probe these without credentials; they reveal only up/down/busy.
- DATA: every inference and information route of every protocol (not only `/v1`, the gap of
  vLLM's `--api-key`), and routes no rule matches. Needs an API key or an admin key.
- METRICS: `/metrics`, `/metrics-json`. Same keys as DATA (a scraper needs no admin rights).
- ADMIN: the control plane and adapter management (`/stopService`, status, config, role, DJL and
  SageMaker `/adapters`, vLLM `/v1/load|unload_lora_adapter` on whatever listener serves them).
  Needs an admin key; with no admin keys configured, an API key (as vLLM guards its LoRA routes).
A class whose key list is empty is open: with no keys at all only mTLS (per listener) guards.

The decision uses Starlette's own route matching on the ASGI `scope["path"]`, the very path the
router dispatches on, never the Host-derived `request.url` (CVE-2026-48710, CVE-2026-48746).
Keys are compared as SHA-256 digests with `hmac.compare_digest` against every configured key, so
neither the key nor its length leaks through timing (CVE-2025-59425). Refusals are 401 with
`WWW-Authenticate: Bearer` in the error envelope of the route's protocol.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from protocols._common.http import ADMIN_KEY
from protocols.djl import errors as djl_errors
from protocols.kserve_v2 import errors as kserve_errors
from protocols.mindie import errors as mindie_errors
from protocols.openai_v1 import errors as openai_errors
from protocols.tgi import errors as tgi_errors
from server.control import mindie_error
from server.core.errors import GatewayError, PayloadTooLarge, Unauthorized
from server.limits import BodyLimitMiddleware
from server.settings import Settings

Render = Callable[[GatewayError], Response]

OPEN_PATHS = frozenset(
    {
        "/",
        "/health",
        "/ping",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/{model}/ready",
        "/v2/models/{model}/versions/{version}/ready",
        "/health/timed",
        "/health/timed-{seconds}",
    }
)
READ_METHODS = frozenset({"GET", "HEAD"})
OPEN_POST_PATHS = frozenset({"/ping"})  # DJL answers POST /ping too
METRICS_LABEL = "metrics"


class Access(enum.Enum):
    OPEN = "open"
    DATA = "data"
    METRICS = "metrics"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class RouteRule:
    """One route of a listener, its access class and how its protocol renders an error."""

    route: BaseRoute | None  # None: the listener's fallback for paths no route matches
    access: Access
    render: Render


class RouteTable:
    """Finds the rule of a request exactly as the router will: same routes, same order."""

    def __init__(self, rules: Sequence[RouteRule], fallback: RouteRule) -> None:
        self.rules = tuple(rules)
        self.fallback = fallback

    def rule_for(self, scope: Scope) -> RouteRule:
        partial: RouteRule | None = None
        for rule in self.rules:
            assert rule.route is not None
            match, _ = rule.route.matches(scope)
            if match is Match.FULL:
                return rule
            if match is Match.PARTIAL and partial is None:
                partial = rule  # path matches, method does not: the router answers 405
        return partial or self.fallback

    def render(self, scope: Scope, exc: GatewayError) -> Response:
        rule = self.rule_for(scope)
        if rule.route is not None:
            scope.setdefault("route", rule.route)  # so the HTTP metrics name the endpoint
        return rule.render(exc)


def access_of(route: BaseRoute, label: str, admin_paths: frozenset[str]) -> Access:
    path: str = getattr(route, "path", "")
    methods = frozenset(getattr(route, "methods", None) or ())
    if path in OPEN_PATHS and (methods <= READ_METHODS or path in OPEN_POST_PATHS):
        return Access.OPEN
    if label == METRICS_LABEL:
        return Access.METRICS
    if path in admin_paths:
        return Access.ADMIN
    return Access.DATA


class Keyring:
    """The configured API and admin keys, kept as digests."""

    def __init__(self, api_keys: Iterable[str], admin_keys: Iterable[str]) -> None:
        self.api = tuple(_digest(k.encode()) for k in api_keys if k)
        self.admin = tuple(_digest(k.encode()) for k in admin_keys if k)

    @property
    def configured(self) -> bool:
        return bool(self.api or self.admin)

    def accepted(self, access: Access) -> tuple[bytes, ...] | None:
        """The digests that open `access`; None when it is open."""
        if access is Access.OPEN:
            return None
        if access is Access.ADMIN:
            return self.admin or self.api or None
        return (self.api + self.admin) if self.api else None

    def allows(self, access: Access, token: bytes | None) -> bool:
        keys = self.accepted(access)
        if keys is None:
            return True
        presented = _digest(token or b"")
        found = False
        for key in keys:  # no early exit: the time does not depend on which key matched
            found |= hmac.compare_digest(presented, key)
        return found and token is not None


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def bearer_token(scope: Scope) -> bytes | None:
    """The token of the first `Authorization: Bearer <token>` header, if any."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() != b"bearer":
                return None
            return token.strip() or None
    return None


class AuthMiddleware:
    """Refuses a request without a key for its route's access class, before the app runs."""

    def __init__(self, app: ASGIApp, *, table: RouteTable, keyring: Keyring) -> None:
        self.app = app
        self.table = table
        self.keyring = keyring

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rule = self.table.rule_for(scope)
        token = bearer_token(scope)
        if self.keyring.allows(rule.access, token):
            scope[ADMIN_KEY] = self.keyring.allows(Access.ADMIN, token)
            await self.app(scope, receive, send)
            return
        if rule.route is not None:
            scope.setdefault("route", rule.route)
        what = "An admin key" if rule.access is Access.ADMIN else "An API key"
        problem = "was not accepted" if token else "is required"
        response = rule.render(Unauthorized(f"{what} {problem} for this route."))
        challenge = 'Bearer error="invalid_token"' if token else "Bearer"
        response.headers["www-authenticate"] = challenge
        await response(scope, receive, send)


# ---- assembly: one table per listener ---------------------------------------------------------
RENDERERS: dict[str, Render] = {
    "openai": openai_errors.render,
    "tgi": tgi_errors.render,
    "kserve": kserve_errors.render,
    "mindie": mindie_errors.render,
    "djl": djl_errors.render,
}
# Paths several protocols share (server/gateway.py `shared_routes`): a refusal made before the
# body is read uses the envelope of the protocol those routes fall back to.
SHARED_PATH_SHAPES = {"/generate": "tgi", "/invocations": "djl", "/tokenize": "tgi"}
RouteGroup = tuple[str, Sequence[BaseRoute]]


CONTROL_STATUS: tuple[tuple[type[GatewayError], int, str], ...] = (
    (Unauthorized, 401, "Unauthorized"),
    (PayloadTooLarge, 413, "Payload Too Large"),
)


def control_render(exc: GatewayError) -> Response:
    """The control plane's (MindIE) envelope `{"error", "error_type"}`."""
    status, reason = next(
        ((code, reason) for cls, code, reason in CONTROL_STATUS if isinstance(exc, cls)),
        (400, "Bad Request"),
    )
    return mindie_error(status, exc.message, error_type=reason)


def renderer(label: str, path: str, access: Access) -> Render:
    label = SHARED_PATH_SHAPES.get(path, label)
    if label == "djl" and access is Access.ADMIN:
        return djl_errors.render_management
    return RENDERERS.get(label, control_render)


def route_table(
    groups: Sequence[RouteGroup], *, roles: Sequence[str], admin_paths: frozenset[str]
) -> RouteTable:
    """The rules of one listener's routes, in the router's order (`groups` as the app got them)."""
    rules = []
    for label, routes in groups:
        for route in routes:
            access = access_of(route, label, admin_paths)
            render = renderer(label, getattr(route, "path", ""), access)
            rules.append(RouteRule(route, access, render))
    if "data" in roles:
        fallback = RouteRule(None, Access.DATA, RENDERERS["openai"])
    elif "management" in roles:
        fallback = RouteRule(None, Access.ADMIN, control_render)
    else:
        fallback = RouteRule(None, Access.METRICS, control_render)
    return RouteTable(rules, fallback)


def protect(app: Starlette, *, table: RouteTable, settings: Settings) -> None:
    """Add the body backstop and, when keys are configured, the credential check. Call it
    before adding the metrics middleware, so that refusals are counted like any response."""
    max_bytes = settings.server.max_request_bytes
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_bytes, render=table.render)
    security = settings.security
    keyring = Keyring(security.api_keys, security.admin_keys)
    if keyring.configured:
        app.add_middleware(AuthMiddleware, table=table, keyring=keyring)
