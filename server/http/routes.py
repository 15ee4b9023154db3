"""What a protocol declares: its routes (per listener, with their access class, error renderer,
body claims on shared paths and overrides), and its spec (name, renderer, route builders, typed
options, start-up paths and hook).

The listener app is built from these declarations once; nothing re-matches a path per request
to find a route's access class or error shape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from server.core.errors import GatewayError
from server.http.access import Access as Access  # routes declare it: re-exported for them
from server.http.context import ProtocolContext

if TYPE_CHECKING:
    from server.http.rpc import GrpcService


class Answer(Protocol):
    """What an endpoint returns: an ASGI response whose status and headers are known before it
    runs (a Starlette `Response`, or `streaming.EventStreamAnswer`)."""

    status_code: int
    raw_headers: list[tuple[bytes, bytes]]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None: ...


Endpoint = Callable[[Request], Awaitable[Answer]]
Render = Callable[[GatewayError], Response]
Claim = Callable[[object], bool]  # on a shared path: does this route take that decoded body?
JSON = dict[str, Any]
Body = type[BaseModel] | JSON | tuple[type[BaseModel], ...] | None
# A hand-written JSON-schema body lists here the wire models its `$ref`s point to.
EMBEDS = "x-embeds"

DATA, MANAGEMENT, METRICS = "data", "management", "metrics"
LISTENERS = (DATA, MANAGEMENT, METRICS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Doc:
    """The route's OpenAPI operation."""

    summary: str
    body: Body = None  # wire model(s), or a JSON schema for bodies with dynamic keys
    query: tuple[str, ...] = ()
    streams: bool = False  # may answer with a stream (SSE or JSON lines)


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """One method on one path. A GET route answers HEAD too."""

    method: str
    path: str  # Starlette-style template: /v2/models/{model}, /v1/models/{model:path}
    endpoint: Endpoint
    owner: str  # the spec that declared it: metrics label, OpenAPI tag
    render: Render  # the error shape before the first byte (and for 401 and 413)
    access: Access = Access.DATA
    listeners: frozenset[str] = frozenset({DATA})
    claim: Claim | None = None  # on a shared path: takes the bodies this accepts
    overrides: frozenset[str] = frozenset()  # owners whose route here it replaces
    doc: Doc | None = None


@dataclass(kw_only=True)
class RouteList:
    """Builds the routes of one owner: `routes.post("/x", endpoint, doc=...)`."""

    owner: str
    render: Render
    listeners: frozenset[str] = frozenset({DATA})
    access: Access = Access.DATA
    routes: list[Route] = field(default_factory=list)

    def add(  # noqa: PLR0913 - the route's own fields, each defaulting to the list's
        self,
        method: str,
        path: str,
        endpoint: Endpoint,
        *,
        doc: Doc | None = None,
        access: Access | None = None,
        listeners: frozenset[str] | None = None,
        render: Render | None = None,
        claim: Claim | None = None,
        overrides: frozenset[str] = frozenset(),
    ) -> None:
        self.routes.append(
            Route(
                method=method,
                path=path,
                endpoint=endpoint,
                owner=self.owner,
                render=render or self.render,
                access=access or self.access,
                listeners=listeners or self.listeners,
                claim=claim,
                overrides=overrides,
                doc=doc,
            )
        )

    def get(self, path: str, endpoint: Endpoint, doc: Doc | None = None, **kw: Any) -> None:
        self.add("GET", path, endpoint, doc=doc, **kw)

    def post(self, path: str, endpoint: Endpoint, doc: Doc | None = None, **kw: Any) -> None:
        self.add("POST", path, endpoint, doc=doc, **kw)


@dataclass(frozen=True, slots=True, kw_only=True)
class Unrouted:
    """How a listener without data routes (management, metrics) answers what no route serves;
    its `render` also shapes the errors of the server's own routes there (OpenAPI, /metrics)."""

    render: Render
    not_found: Callable[[Scope], Response]
    method_not_allowed: Callable[[tuple[str, ...]], Response]


@dataclass(frozen=True, slots=True, kw_only=True)
class ProtocolSpec:
    """Everything the server needs to serve one protocol; exported as `SPEC` by its package."""

    name: str  # closed-set label: metrics, logs, OpenAPI tags
    render: Render  # its error envelope for a domain error
    routes: Callable[[ProtocolContext], Sequence[Route]]
    live_paths: frozenset[str] = frozenset()  # GET paths that answer 200 while the engine starts
    # templates of the data paths it answers by default (not by a body claim), so that its
    # `render` answers them while the engine starts (server/http/starting.py)
    paths: frozenset[str] = frozenset()
    grpc: Callable[[ProtocolContext], Sequence[GrpcService]] | None = None  # its gRPC services
    # its control plane on the management and metrics listeners (built after every spec's data
    # routes, from a context that carries the server port), and how those listeners answer
    # paths no route serves; at most one spec declares `unrouted`
    management: Callable[[ProtocolContext], Sequence[Route]] | None = None
    unrouted: Unrouted | None = None
    # its typed options: a dataclass whose fields name the settings it reads (context.py
    # `options_of`); the server hands protocols only settings some spec declares
    options: type[Any] | None = None
    # run once at start, after the start-up adapters are registered (e.g. DJL's workflows)
    startup: Callable[[ProtocolContext], Awaitable[None]] | None = None
