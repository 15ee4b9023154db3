"""The listener app: the gateway's one pure-ASGI layer and its router, built once per listener.

Per request, in this order: resolve the route (once; its access class and error shape travel
with it), take the request id (`X-Request-Id` or a new one, echoed on the answer and set for the
logs), refuse a declared body over the limit (413), check credentials (401), count the bytes of a
chunked body, run the endpoint (a domain error becomes the route's error answer), add
`Connection: close` while the server is not ready (so keep-alive clients move on during a drain)
and `X-Gateway-Overhead-Ms` (below), send, and report the answer to the observer (HTTP metrics,
access log).

`X-Gateway-Overhead-Ms` is the gateway's own time on the request, in milliseconds: the wall time
from the request's arrival at this app to its response headers, minus the time it waited on the
engine meanwhile (an admission slot, an adapter load, the engine's outputs; `EngineWait`). For a
non-streamed answer that covers the whole request; for a stream, the time to its first byte
minus the engine's time to its first output.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from starlette.datastructures import URL
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.types import Message, Receive, Scope, Send

from server.core.errors import Unauthorized
from server.core.overhead import EngineWait, engine_wait_var
from server.http.auth import Keyring, presented_key
from server.http.body import JsonResponse, too_large
from server.http.context import (
    ADMIN_KEY,
    CLIENT_ID_KEY,
    MAX_REQUEST_ID,
    OWNER_KEY,
    AccessNote,
    access_note_var,
    new_request_id,
    request_id_var,
)
from server.http.router import Resolution, Router, guarded
from server.http.routes import Access, Answer, Render

UNMATCHED = "unmatched"  # the endpoint label of a request no route matched
OTHER = "other"  # the protocol label of such a request
OVERHEAD_HEADER = b"x-gateway-overhead-ms"


class HttpObserver(Protocol):
    def response(
        self, scope: Scope, owner: str, endpoint: str, status: int, seconds: float
    ) -> None:
        """One answered request: its protocol, route template, status and duration."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fallback:
    """How a listener answers what no route serves."""

    render: Render  # errors (401, 413) on paths no route matches
    access: Access  # who may learn that a path does not exist
    not_found: Callable[[Scope], Response]
    method_not_allowed: Callable[[tuple[str, ...]], Response]


def fastapi_not_found(scope: Scope) -> Response:
    """vLLM's answer for a path no route serves: FastAPI's default handler of the 404 that
    Starlette's router raises (vLLM registers its own error shape only for FastAPI's subclass)."""
    return JsonResponse(b'{"detail":"Not Found"}', 404)


def fastapi_method_not_allowed(allowed: tuple[str, ...]) -> Response:
    """vLLM's answer for a known path and another method (FastAPI's default handler)."""
    return JsonResponse(
        b'{"detail":"Method Not Allowed"}', 405, headers={"Allow": ", ".join(allowed)}
    )


class ListenerApp:
    def __init__(  # noqa: PLR0913 - the listener's parts, all built by the gateway
        self,
        router: Router,
        fallback: Fallback,
        *,
        max_body_bytes: int,
        keyring: Keyring,
        observer: HttpObserver,
        closing: Callable[[], bool],
        access_notes: bool = True,
    ) -> None:
        """`access_notes`: keep an `AccessNote` per request (only the access log reads it)."""
        self._router = router
        self._fallback = fallback
        self._max_body = max_body_bytes
        self._keyring = keyring
        self._observer = observer
        self._closing = closing
        self._notes = access_notes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # uvicorn runs with lifespan off and no WebSocket support
        started = time.perf_counter()
        request_id = authorization = api_key = length = None
        for name, value in scope["headers"]:  # uvicorn lower-cases header names
            if name == b"x-request-id" and request_id is None:
                request_id = value
            elif name == b"authorization" and authorization is None:
                authorization = value
            elif name == b"x-api-key" and api_key is None:
                api_key = value
            elif name == b"content-length":
                length = value
        rid = request_id.decode("latin-1") if request_id else ""
        if rid and len(rid) <= MAX_REQUEST_ID:
            scope[CLIENT_ID_KEY] = rid
        else:
            scope[CLIENT_ID_KEY] = None  # looked at: routes need not read the headers again
            rid = new_request_id()
        token = request_id_var.set(rid)
        note = access_note_var.set(AccessNote()) if self._notes else None
        wait = EngineWait()
        wait_token = engine_wait_var.set(wait)
        resolution = self._router.resolve(scope["method"], scope["path"])
        try:
            key = presented_key(authorization, api_key) if self._keyring.configured else None
            answer = await self._answer(scope, receive, resolution, key, length)
            self._finish_headers(answer, rid)
            now = time.perf_counter()
            overhead_ms = max(now - started - wait.total(now), 0.0) * 1000
            answer.raw_headers.append((OVERHEAD_HEADER, b"%.2f" % overhead_ms))
            try:
                await answer(scope, receive, send)
            finally:
                self._report(scope, resolution, answer.status_code, started)
        finally:
            engine_wait_var.reset(wait_token)
            if note is not None:
                access_note_var.reset(note)
            request_id_var.reset(token)

    async def _answer(
        self,
        scope: Scope,
        receive: Receive,
        resolution: Resolution,
        token: bytes | None,
        length: bytes | None,
    ) -> Answer:
        entry = resolution.entry
        render = entry.render if entry else self._fallback.render
        access = entry.access if entry else self._fallback.access
        if self._keyring.configured:
            refusal = self._authorize(scope, access, render, token)
            if refusal is not None:
                return refusal
        if length is not None:
            if length.isdigit() and int(length) > self._max_body:
                return render(too_large(self._max_body))
        else:
            receive = _counted(receive, self._max_body)
        if entry is None or resolution.allowed:
            return self._unserved(scope, resolution)
        scope["path_params"] = resolution.params or {}  # a static path's resolution is shared
        return await guarded(entry.endpoint, render, Request(scope, receive))

    def _authorize(
        self, scope: Scope, access: Access, render: Render, token: bytes | None
    ) -> Answer | None:
        keyring = self._keyring
        if keyring.allows(access, token):
            scope[ADMIN_KEY] = keyring.allows(Access.ADMIN, token)
            return None
        what = "An admin key" if access is Access.ADMIN else "An API key"
        problem = "was not accepted" if token else "is required"
        response = render(Unauthorized(f"{what} {problem} for this route."))
        challenge = b'Bearer error="invalid_token"' if token else b"Bearer"
        response.raw_headers.append((b"www-authenticate", challenge))
        return response

    def _unserved(self, scope: Scope, resolution: Resolution) -> Answer:
        """405 for a known path, a redirect for a path known with(out) a trailing slash, 404."""
        if resolution.allowed:
            return self._fallback.method_not_allowed(resolution.allowed)
        path: str = scope["path"]
        if path != "/":
            other = path.rstrip("/") if path.endswith("/") else path + "/"
            if self._router.knows(other):
                return RedirectResponse(url=str(URL(scope={**scope, "path": other})))
        return self._fallback.not_found(scope)

    def _finish_headers(self, answer: Answer, request_id: str) -> None:
        headers = answer.raw_headers
        for name, _ in headers:
            if name == b"x-request-id":
                break
        else:  # a loop, not all(<generator>): this runs for every answer
            headers.append((b"x-request-id", request_id.encode("latin-1")))
        if self._closing():
            headers[:] = [(k, v) for k, v in headers if k != b"connection"]
            headers.append((b"connection", b"close"))

    def _report(self, scope: Scope, resolution: Resolution, status: int, started: float) -> None:
        entry = resolution.entry
        if entry is None:
            owner, endpoint = OTHER, UNMATCHED
        else:
            owner, endpoint = scope.get(OWNER_KEY) or entry.owner, entry.template
        self._observer.response(scope, owner, endpoint, status, time.perf_counter() - started)


def _counted(receive: Receive, max_bytes: int) -> Receive:
    """`receive` that raises PayloadTooLarge once a chunked body passes `max_bytes`."""
    received = 0

    async def counted() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise too_large(max_bytes)
        return message

    return counted
