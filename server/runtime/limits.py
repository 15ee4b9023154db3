"""HTTP limits below and at the ASGI edge: what uvicorn with httptools does not bound by itself.

Measured (RELIABILITY_PERF.md B.4): httptools accepts an 8 MB header, nothing bounds how long a
request may take to arrive (slowloris), and a client that stops reading a stream holds its
admission slot forever. `limited_protocol` wraps uvicorn's httptools protocol class:

- request head: at most `maxHeaderCount` headers and `maxHeaderBytes` bytes (request line and
  headers) → 431 (414 for an over-long URL) and the connection closed; the raw bytes of a head
  still incomplete are counted too, so a single endless header is cut off early;
- `requestReceiveTimeout`: a whole request (head and body) must arrive within this many seconds
  of its first byte (of the connection, for a connection's first request) → 408 and close.
  The deadline is disarmed once the request is complete, so long streams are unaffected
  (the idea of xorbitsai/inference#5213's RequestDeadlineMixin);
- `sendTimeout`: a client that leaves our output unread for this long is dropped, which aborts
  its engine request and frees its slot;
- at most 3 × `maxLinkNum` connections per listener (MindIE: maxLinkNum served, twice that
  queued, the next refused): an idle keep-alive connection is closed to make room, and if none
  is idle the new connection gets 503 and is closed.

The subclass overrides uvicorn's parser callbacks and reads its request cycle, which are not a
public API: pyproject.toml pins uvicorn to the minor release it was written against
(`UVICORN_SERIES`), and `check_uvicorn()` refuses to start with any other.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, ClassVar, TypeGuard

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.settings import ServerSettings

CONNECTIONS_PER_LINK = 3  # MindIE: maxLinkNum served + 2 × maxLinkNum queued
UVICORN_SERIES = "0.54"  # the minor release `LimitedHttpToolsProtocol` was written against


class UnsupportedUvicorn(RuntimeError):
    """Another uvicorn than the one the HTTP limits were written against is installed."""


def check_uvicorn(version: str = uvicorn.__version__) -> None:
    """Refuse to start on a uvicorn whose private protocol internals may have changed."""
    if version.split(".")[:2] != UVICORN_SERIES.split("."):
        raise UnsupportedUvicorn(
            f"uvicorn {version} is installed, but the HTTP limits (server/runtime/limits.py) "
            f"subclass uvicorn {UVICORN_SERIES}.x's httptools protocol. Fix: "
            f"pip install 'uvicorn[standard]=={UVICORN_SERIES}.*' (as pyproject.toml pins it)"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpLimits:
    max_header_bytes: int
    max_header_count: int
    receive_timeout_s: float
    send_timeout_s: float
    max_connections: int

    @classmethod
    def from_settings(cls, server: ServerSettings) -> HttpLimits:
        return cls(
            max_header_bytes=server.max_header_bytes,
            max_header_count=server.max_header_count,
            receive_timeout_s=server.request_receive_timeout_s,
            send_timeout_s=server.send_timeout_s,
            max_connections=server.max_links * CONNECTIONS_PER_LINK,
        )


_base = HttpToolsProtocol


class _HeadRefused(Exception):
    """Raised inside a parser callback; httptools turns it into HttpParserCallbackError."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head limits, a receive deadline, a send timeout and a
    connection cap. Subclassed per listener by `limited_protocol` (which sets `limits`)."""

    limits: ClassVar[HttpLimits]
    _max_head: ClassVar[int]  # limits.max_header_bytes
    _max_count: ClassVar[int]  # limits.max_header_count

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._since = 0.0  # when the request now arriving began (loop time)
        self._arriving = False  # a deadline counts from `_since`
        self._stalled: asyncio.TimerHandle | None = None
        self._in_message = False  # a request has begun and not fully arrived
        self._in_head = True  # bytes now arriving belong to a request head
        self._raw_head = 0
        self._head_bytes = 0
        self._header_count = 0
        self._refusal: tuple[int, str] | None = None

    # ---- connection ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            self._answer(503, "Too many connections")
            return
        self._arm_deadline()  # a fresh connection must deliver its first request in time

    def connection_lost(self, exc: Exception | None) -> None:
        self._arriving = False
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._cancel_stall()
        super().connection_lost(exc)

    def _make_room(self) -> bool:
        """Close one idle keep-alive connection (nginx does the same); False if none is idle."""
        idle = [c for c in self.connections if c is not self and _idle(c)]
        if not idle:
            return False
        idle.sort(key=_never_used)  # served-and-idle first, then those that sent nothing yet
        victim = idle[0]
        victim.transport.close()
        self.connections.discard(victim)
        return True

    # ---- request head ---------------------------------------------------------------------
    # The callbacks below run for every request: they call uvicorn's own directly (not through
    # super(), a lookup per call) and read the limits from the class (`limited_protocol`).
    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._raw_head += len(data)
        _base.data_received(self, data)
        too_long = self._in_head and self._raw_head > self._max_head
        if too_long and not self.transport.is_closing():
            self._answer(431, "Request header fields too large")

    def on_message_begin(self) -> None:
        _base.on_message_begin(self)
        self._in_message = True
        self._in_head = True
        self._head_bytes = 0
        self._header_count = 0
        self._arm_deadline()

    # on_url and on_header do uvicorn's part themselves (`self.url += url`; the lower-cased
    # header appended, `Expect: 100-continue` noted) instead of calling it: they run for every
    # header of every request, and the pinned uvicorn (UVICORN_SERIES) does exactly this.
    def on_url(self, url: bytes) -> None:
        self.url += url
        self._head_bytes += len(url)
        if len(self.url) > self._max_head:
            self._refuse(414, "URI too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self._header_count > self._max_count:
            self._refuse(431, "Too many request header fields")
        if self._head_bytes > self._max_head:
            self._refuse(431, "Request header fields too large")
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._raw_head = 0
        _base.on_headers_complete(self)

    def on_message_complete(self) -> None:
        self._in_message = False
        self._in_head = True
        self._raw_head = 0
        self._arriving = False  # the deadline's timer, if armed, finds nothing to time out
        _base.on_message_complete(self)

    def _refuse(self, status: int, message: str) -> None:
        self._refusal = (status, message)
        raise _HeadRefused(message)

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this for every parser error; ours carry their own status."""
        status, text = self._refusal or (400, msg)
        self._answer(status, text)

    # ---- deadlines -----------------------------------------------------------------------
    # One timer per connection, not one per request: a request that arrives in time leaves the
    # timer armed (`_arriving` off); when it fires, it times out the request arriving then if
    # that one is overdue, re-arms for its remaining time if not, and stays off while idle.
    def _arm_deadline(self) -> None:
        """The request now arriving must be complete within the receive timeout (from the
        connection's start for its first request: the deadline then already counts)."""
        if self._arriving:
            return
        self._arriving = True
        self._since = self.loop.time()
        if self._deadline is None:
            self._deadline = self.loop.call_later(
                self.limits.receive_timeout_s, self._check_deadline
            )

    def _check_deadline(self) -> None:
        self._deadline = None
        if not self._arriving:
            return
        left = self._since + self.limits.receive_timeout_s - self.loop.time()
        if left > 0:
            self._deadline = self.loop.call_later(left, self._check_deadline)
            return
        self._arriving = False
        self._request_timed_out()

    def _request_timed_out(self) -> None:
        if self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()
        else:
            self._answer(408, "Request not received in time")

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.limits.send_timeout_s, self._send_stalled)

    def resume_writing(self) -> None:
        self._cancel_stall()
        super().resume_writing()

    def _cancel_stall(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _send_stalled(self) -> None:
        self._stalled = None
        self.logger.info("dropping a client that read nothing for %ss", self.limits.send_timeout_s)
        self.transport.abort()  # close() would wait for the unread buffer to drain

    # ---- answers written below ASGI ------------------------------------------------------
    def _answer(self, status: int, message: str) -> None:
        body = message.encode("ascii")
        head = (
            f"HTTP/1.1 {status} {message}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            cycle.disconnected = True  # the app's receive says so; its answer goes nowhere
            cycle.message_event.set()
        self.transport.write(head.encode("ascii") + body)
        self.transport.close()


def _idle(connection: object) -> TypeGuard[LimitedHttpToolsProtocol]:
    """No request in progress on this connection: between requests or never used."""
    if not isinstance(connection, LimitedHttpToolsProtocol):
        return False
    cycle = connection.cycle
    return not connection._in_message and (cycle is None or cycle.response_complete)


def _never_used(connection: LimitedHttpToolsProtocol) -> bool:
    return connection.cycle is None


def limited_protocol(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """A protocol class for one listener (uvicorn instantiates it per connection)."""
    return type(
        "ListenerHttpProtocol",
        (LimitedHttpToolsProtocol,),
        {
            "limits": limits,
            "_max_head": limits.max_header_bytes,
            "_max_count": limits.max_header_count,
        },
    )
