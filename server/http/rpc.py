"""The gRPC side of the toolkit: what a protocol declares to serve gRPC, and the one interceptor
every call passes (bearer keys from the `authorization` metadata, then the observer).

A protocol's `ProtocolSpec.grpc` builds `GrpcService`s from the protocol context; the runtime
adds them to one grpc.aio server. Like the HTTP listener app, nothing here reads settings or
knows a protocol.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import grpc
from grpc import aio

from server.core.overhead import EngineWait, engine_wait_var
from server.http.access import Access
from server.http.auth import Keyring, bearer_token

AUTHORIZATION = "authorization"
API_KEY_NEEDED = "This server requires an API key: send it as 'authorization: Bearer <key>'"
CERTIFICATE_REVOKED = "The client certificate has been revoked."
OVERHEAD_METADATA = "x-gateway-overhead-ms"  # as the HTTP header, on unary calls' trailers

if TYPE_CHECKING:
    Context: TypeAlias = aio.ServicerContext[Any, Any]
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpcService:
    """One gRPC service: its full name, how its handlers are added to a server, and the methods
    (full paths, `/package.Service/Method`) that need no key (health probes)."""

    name: str
    owner: str  # the protocol that declared it: metrics label
    add_to: Callable[[aio.Server], None]
    open_methods: frozenset[str] = frozenset()


class RpcObserver(Protocol):
    def rpc(self, owner: str, method: str, code: str, seconds: float) -> None:
        """One finished call: its protocol, method name, status code name and duration."""


class AccessInterceptor(aio.ServerInterceptor):
    """Refuses a call without an accepted bearer key (UNAUTHENTICATED) and reports every call
    to the observer with its final status code."""

    def __init__(
        self,
        keyring: Keyring,
        services: tuple[GrpcService, ...],
        observer: RpcObserver,
        peer_allowed: Callable[[bytes], bool] | None = None,
    ) -> None:
        self._keyring = keyring
        self._open = frozenset(m for s in services for m in s.open_methods)
        self._owners = {s.name: s.owner for s in services}
        self._observer = observer
        self._peer_allowed = peer_allowed  # the client certificate (PEM) is not revoked

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method: str = details.method
        service, _, name = method.lstrip("/").partition("/")
        handler = await continuation(details)
        if handler is None:
            return None
        owner = self._owners.get(service, service)
        if not self._allowed(method, details.invocation_metadata):
            handler = _refusal(handler, API_KEY_NEEDED)
        return _observed(handler, owner, name, self._observer, self._peer_revoked)

    def _peer_revoked(self, context: Context) -> bool:
        if self._peer_allowed is None:
            return False
        certificates = list(context.auth_context().get("x509_pem_cert") or ())
        return not self._peer_allowed(certificates[0] if certificates else b"")

    def _allowed(self, method: str, metadata: Any) -> bool:
        if method in self._open:
            return True
        token = None
        for key, value in metadata or ():
            if key == AUTHORIZATION:
                raw = value.encode() if isinstance(value, str) else value
                token = bearer_token(raw)
        return self._keyring.allows(Access.DATA, token)


def _refusal(handler: Handler, message: str) -> Handler:
    async def refuse(request: Any, context: Context) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request: Any, context: Context) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    return _same_shape(handler, refuse, refuse_stream)


def _observed(
    handler: Handler,
    owner: str,
    method: str,
    observer: RpcObserver,
    revoked: Callable[[Context], bool],
) -> Handler:
    """`handler` with its behaviour timed and its final status reported; a revoked client
    certificate is refused first."""
    if_revoked = _refusal(handler, CERTIFICATE_REVOKED)
    inner, refused = _behaviour(handler), _behaviour(if_revoked)

    def report(context: Context, started: float, failed: BaseException | None) -> None:
        code = context.code()
        if code is None:
            code = grpc.StatusCode.CANCELLED if failed is not None else grpc.StatusCode.OK
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        observer.rpc(owner, method, name, time.perf_counter() - started)

    async def unary(request: Any, context: Context) -> Any:
        started, failed = time.perf_counter(), None
        behaviour = refused if revoked(context) else inner
        wait = EngineWait()
        token = engine_wait_var.set(wait)
        try:
            answer = await behaviour(request, context)
            now = time.perf_counter()
            overhead_ms = max(now - started - wait.total(now), 0.0) * 1000
            context.set_trailing_metadata(((OVERHEAD_METADATA, f"{overhead_ms:.2f}"),))
            return answer
        except BaseException as exc:
            failed = exc
            raise
        finally:
            engine_wait_var.reset(token)
            report(context, started, failed)

    async def streaming(request: Any, context: Context) -> Any:
        started, failed = time.perf_counter(), None
        behaviour = refused if revoked(context) else inner
        try:
            async for item in behaviour(request, context):
                yield item
        except BaseException as exc:
            failed = exc
            raise
        finally:
            report(context, started, failed)

    return _same_shape(handler, unary, streaming)


def _behaviour(handler: Handler) -> Any:
    return (
        handler.unary_unary
        or handler.unary_stream
        or handler.stream_unary
        or handler.stream_stream
    )


def _same_shape(
    handler: Handler, unary: Any, streaming: Any
) -> Handler:
    """A handler of `handler`'s kind and (de)serializers with another behaviour: `unary` for
    calls answering one message, `streaming` for calls answering a stream."""
    kinds = (
        (handler.unary_unary, grpc.unary_unary_rpc_method_handler, unary),
        (handler.unary_stream, grpc.unary_stream_rpc_method_handler, streaming),
        (handler.stream_unary, grpc.stream_unary_rpc_method_handler, unary),
        (handler.stream_stream, grpc.stream_stream_rpc_method_handler, streaming),
    )
    for present, build, behaviour in kinds:
        if present is not None:
            return build(
                behaviour,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    raise ValueError("a gRPC method handler without a behaviour")
