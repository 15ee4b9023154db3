"""The opt-in HTTP runner `ServerConfig.httpRunner: "granian"`: one granian ASGI worker per
listener, embedded in the gateway's own event loop (as the uvicorn servers are), serving the
socket bound before the engine starts.

granian parses HTTP and terminates TLS in Rust threads and schedules each request's ASGI call
onto this loop. What uvicorn's path enforces (server/runtime/limits.py), granian enforces so:

- mutual TLS from the same `Tls` settings: the files are checked by `build_context` first (the
  same start-up errors), then handed to rustls: TLS 1.2 minimum (rustls offers only AEAD
  suites with forward secrecy), client certificate required and verified against the CA, CRLs
  checked (rustls checks the whole chain; OpenSSL's path only the leaf). One CA file only
  (else a configuration error); an encrypted key is decrypted with its tlsPkPwd into memory;
- request head: hyper's read buffer (`maxHeaderBytes` + 8 KiB) and
  its fixed cap of 100 headers answer 431 below ASGI; `HeadAndDeadlines` applies the exact
  `maxHeaderBytes`/`maxHeaderCount` of uvicorn's path to what arrived;
- `requestReceiveTimeout`: hyper's header read timeout bounds the head (and an idle
  keep-alive connection); `HeadAndDeadlines` bounds the body's arrival (408, connection close);
- `sendTimeout`: a streamed body chunk the client leaves unread this long drops the client;
- connections: at most 3 × `maxLinkNum` per listener are served; further ones wait in the
  listen backlog (uvicorn's path closes an idle one or answers 503);
- graceful stop: stop accepting, let open requests finish, close idle connections.

The worker is built from granian's own parts (`ASGIWorker`, its callback scheduler), which
are not a public API: pyproject.toml pins granian to `GRANIAN_SERIES`, checked at start.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import socket
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.runtime.limits import HttpLimits
from server.runtime.tls import TlsFiles, build_context, plain_key
from server.settings import SettingsError

logger = logging.getLogger("gateway")
GRANIAN_SERIES = "2.8"  # the minor release the worker below was written against
HYPER_MIN_BUFFER = 8192  # hyper refuses a smaller read buffer
HYPER_MAX_HEADERS = 100  # hyper's fixed header cap
BACKLOG = 1024


def check_granian(version: str | None = None) -> None:
    """SettingsError unless the granian this runner was written against is installed
    (`version`: the installed one unless given)."""
    if version is None:
        try:
            version = importlib.metadata.version("granian")
        except importlib.metadata.PackageNotFoundError:
            raise SettingsError(
                "ServerConfig.httpRunner is \"granian\" but granian is not installed. Fix: "
                f"pip install 'llm-gateway[granian]' (granian=={GRANIAN_SERIES}.*), or set "
                'httpRunner to "uvicorn"'
            ) from None
    if version.split(".")[:2] != GRANIAN_SERIES.split("."):
        raise SettingsError(
            f"ServerConfig.httpRunner: granian {version} is installed, but the runner "
            f"(server/runtime/granian_runner.py) embeds granian {GRANIAN_SERIES}.x's worker. "
            f"Fix: pip install 'granian=={GRANIAN_SERIES}.*'"
        )


def check_limits(limits: HttpLimits) -> None:
    """What granian cannot honour is refused at start, never served weaker."""
    if limits.max_header_count > HYPER_MAX_HEADERS:
        raise SettingsError(
            f"ServerConfig.maxHeaderCount {limits.max_header_count}: with httpRunner "
            f'"granian" at most {HYPER_MAX_HEADERS} headers are accepted (hyper\'s fixed cap). '
            f'Fix: set maxHeaderCount to {HYPER_MAX_HEADERS} or less, or httpRunner "uvicorn"'
        )


def in_memory_file(content: bytes) -> str:
    """A path to `content` that lives in this process's memory only (a memfd, never on disk):
    granian reads the key from a path, and its own decryption reads PKCS#8 with AES-CBC only.
    The descriptor stays open for the process's life (a few hundred bytes)."""
    fd = os.memfd_create("tls-key", os.MFD_CLOEXEC)
    os.write(fd, content)
    return f"/proc/self/fd/{fd}"


def tls_arguments(files: TlsFiles) -> dict[str, Any]:
    """granian's TLS arguments for `files`, after the checks uvicorn's path makes."""
    build_context(files)  # every file error, named as on uvicorn's path
    if len(files.ca_files) != 1:
        raise SettingsError(
            f"{files.listener} listener: ServerConfig.tlsCaFile: httpRunner \"granian\" takes "
            "one CA file. Fix: concatenate the CA certificates into one PEM file"
        )
    key = files.key
    if files.key_password_file is not None:
        key = in_memory_file(plain_key(files))
    return {
        "ssl_enabled": True,
        "ssl_cert": files.cert,
        "ssl_key": key,
        "ssl_key_password": None,
        "ssl_protocol_min": "tls1.2",
        "ssl_ca": files.ca_files[0],
        "ssl_crl": list(files.crl_files),
        "ssl_client_verify": True,
    }


class GranianServer:
    """One listener served by an embedded granian ASGI worker; the surface of
    server/runtime/listeners.py's `HttpServer` (`serve`, `started`, `stop`)."""

    def __init__(
        self, app: ASGIApp, limits: HttpLimits, tls: TlsFiles | None, grace_s: float
    ) -> None:
        check_granian()
        check_limits(limits)
        logging.getLogger("_granian").setLevel(logging.WARNING)  # "Started worker-1" per listener
        self._app = HeadAndDeadlines(app, limits)
        self._limits = limits
        self._tls = tls_arguments(tls) if tls is not None else {"ssl_enabled": False}
        self._grace_s = grace_s
        self._signal: Any = None
        self._done: asyncio.Future[None] | None = None
        self.started = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        from granian._granian import ASGIWorker, SocketHolder, WorkerSignal
        from granian.http import HTTP1Settings

        assert sockets is not None and len(sockets) == 1, "one bound socket per listener"
        sock = sockets[0]
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        signal = WorkerSignal()
        signal.add_cb(lambda: loop.call_soon_threadsafe(_finish, done))
        http1 = HTTP1Settings(
            header_read_timeout=int(self._limits.receive_timeout_s * 1000),
            keep_alive=True,
            # room past the limit, so the exact limits below answer (414 for a long URL)
            max_buffer_size=self._limits.max_header_bytes + HYPER_MIN_BUFFER,
        )
        # Nagle's algorithm off, as uvicorn sets it per connection: a connection accepted from
        # this socket inherits it, and without it each stream's last small write waited for the
        # client's delayed acknowledgement (40 ms per streamed answer under wrk)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # granian closes the descriptor it is given when it stops; the bound socket stays ours
        holder = SocketHolder(os.dup(sock.fileno()), False, BACKLOG)  # type: ignore[call-arg]
        new_worker: Any = ASGIWorker  # its stub lags the 2.8 signature (the `ipc` argument)
        worker = new_worker(
            1, (None, holder), None,
            backpressure=self._limits.max_connections, http_mode="1", http1_opts=http1,
            websockets_enabled=False, **self._tls,
        )
        worker.serve_async(_scheduler(loop, self._app), loop, signal)
        self._signal, self._done = signal, done
        self.started = True
        try:
            await done
        finally:
            sock.close()

    def stop(self) -> None:
        """Stop accepting; open requests finish, idle connections close (at most `grace_s`)."""
        self._app.stop()
        if self._signal is None or self._done is None:
            return
        self._signal.set()
        asyncio.get_running_loop().call_later(self._grace_s, _finish, self._done)


def _finish(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def _scheduler(loop: asyncio.AbstractEventLoop, app: ASGIApp) -> Any:
    """granian's callback scheduler: each request's ASGI call as a task on `loop`."""
    from granian._futures import _future_watcher_wrapper, _new_cbscheduler
    from granian.asgi import _callback_wrapper

    call = _future_watcher_wrapper(_callback_wrapper(app, {}, {}, None))  # type: ignore[no-untyped-call]
    return _new_cbscheduler(loop, call, impl_asyncio=True)  # type: ignore[no-untyped-call]


# ---- ASGI edge --------------------------------------------------------------------------------
# The deadlines are kept by one sweep per listener, not a timer per request or per send: an
# `asyncio.timeout` around every streamed send cost ~4 µs per event (bench/ANALYSIS.md, the
# granian runner). A deadline is therefore noticed up to a quarter of its timeout late.
class HeadAndDeadlines:
    """What uvicorn's protocol class enforces below ASGI, enforced at the ASGI edge: the exact
    head limits (431/414), the body's arrival deadline (408) and the send timeout."""

    def __init__(self, app: ASGIApp, limits: HttpLimits) -> None:
        self.app = app
        self.limits = limits
        self.watch = _Watch(limits)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = head_refusal(scope, self.limits)
        if refusal is not None:
            await answer_and_close(send, *refusal)
            return
        request = _Deadlines(self.watch, receive, send)
        try:
            await self.app(scope, request.receive, request.send)
        finally:
            self.watch.forget(request)
        if request.timed_out and not request.started:
            await answer_and_close(send, 408, "Request not received in time")

    def stop(self) -> None:
        self.watch.stop()


def head_refusal(scope: Scope, limits: HttpLimits) -> tuple[int, str] | None:
    """(status, reason) when the head breaks a limit, counted as uvicorn's path counts it."""
    headers = scope["headers"]
    if len(headers) > limits.max_header_count:
        return 431, "Too many request header fields"
    query = len(scope["query_string"])
    url = len(scope.get("raw_path") or scope["path"].encode()) + (query + 1 if query else 0)
    if url > limits.max_header_bytes:
        return 414, "URI too long"
    size = url + sum(len(name) + len(value) + 4 for name, value in headers)
    if size > limits.max_header_bytes:
        return 431, "Request header fields too large"
    return None


async def answer_and_close(send: Send, status: int, message: str) -> None:
    body = message.encode("ascii")
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode("ascii")),
            (b"connection", b"close"),
        ],
    })
    await send({"type": "http.response.body", "body": body})


class _Watch:
    """The requests of one listener whose body is arriving or whose stream is being sent, and
    the sweep that times them out."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.arriving: dict[_Deadlines, float] = {}  # request -> loop time its body is due
        self.streaming: set[_Deadlines] = set()
        self._sweep: asyncio.TimerHandle | None = None
        self._every = min(limits.receive_timeout_s, limits.send_timeout_s) / 4

    def arrive(self, request: _Deadlines, loop: asyncio.AbstractEventLoop) -> None:
        self.arriving[request] = loop.time() + self.limits.receive_timeout_s
        if self._sweep is None:
            self._sweep = loop.call_later(self._every, self.sweep, loop)

    def forget(self, request: _Deadlines) -> None:
        self.arriving.pop(request, None)
        self.streaming.discard(request)

    def sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for request, due in list(self.arriving.items()):
            # only a request whose app waits for its body now: one that never reads it (a long
            # GET /stopService, POST /ping) is not timed out for taking its time
            if now >= due and request.receiving:
                del self.arriving[request]
                request.overdue()
        for request in list(self.streaming):
            request.check_send(now, self.limits.send_timeout_s)
        self._sweep = loop.call_later(self._every, self.sweep, loop)

    def stop(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None


class _Deadlines:
    """One request's receive (the body must arrive by the deadline: 408) and send (a streamed
    chunk the client leaves untaken for the send timeout drops the client). The sweep cancels
    the request's task inside the overdue receive or send, which turns that into a disconnect
    or a ConnectionAbortedError."""

    __slots__ = ("_in_send", "_receive", "_seen", "_send", "_sends", "_task",
                 "_watch", "receiving", "stalled", "started", "timed_out")

    def __init__(self, watch: _Watch, receive: Receive, send: Send) -> None:
        self._watch = watch
        self._receive = receive
        self._send = send
        self._task = asyncio.current_task()
        self.receiving = False
        self._in_send = False
        self._sends = 0  # streamed sends begun
        self._seen: tuple[int, float] | None = None  # (send, when the sweep first saw it pending)
        self.started = False
        self.timed_out = False
        self.stalled = False
        watch.arrive(self, asyncio.get_running_loop())

    async def receive(self) -> Message:
        if self.timed_out:
            return {"type": "http.disconnect"}
        self.receiving = True
        try:
            message = await self._receive()
        except asyncio.CancelledError:
            if not self.timed_out or self._task is None:
                raise
            self._task.uncancel()
            return {"type": "http.disconnect"}  # the app's answer goes nowhere; 408 follows
        finally:
            self.receiving = False
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._watch.arriving.pop(self, None)
        return message

    def overdue(self) -> None:
        self.timed_out = True
        if self._task is not None:
            self._task.cancel()

    async def send(self, message: Message) -> None:
        if self.timed_out:
            return
        if message["type"] == "http.response.start":
            self.started = True
        elif message.get("more_body", False) and not self._in_send:
            self._watch.streaming.add(self)
        if self not in self._watch.streaming:
            await self._send(message)
            return
        self._sends += 1
        self._in_send = True
        try:
            await self._send(message)
        except asyncio.CancelledError:
            if not self.stalled or self._task is None:
                raise
            self._task.uncancel()
            limit = self._watch.limits.send_timeout_s
            logger.info("dropping a client that read nothing for %ss", limit)
            raise ConnectionAbortedError("the client read nothing in time") from None
        finally:
            self._in_send = False

    def check_send(self, now: float, limit: float) -> None:
        """From the sweep: drop the client when one send has been pending for `limit`."""
        if not self._in_send:
            self._seen = None
            return
        if self._seen is None or self._seen[0] != self._sends:
            self._seen = (self._sends, now)
        elif now - self._seen[1] >= limit and self._task is not None:
            self.stalled = True
            self._task.cancel()
