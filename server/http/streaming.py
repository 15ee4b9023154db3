"""The one streaming path: every protocol's stream is an `EventStreamAnswer` driving the
request's events through that protocol's `StreamFormat`.

The driver owns what every stream needs and what each protocol used to get slightly different:
bytes go out as they are produced; an error after the first byte (a domain error, an unexpected
exception, an encoder that raises, the engine dying mid-stream) becomes the protocol's in-band
error frame; a client that disconnects cancels the producer at once; and on every exit the
events are closed, which aborts the engine request and frees its slot.

Why not sse-starlette: it cost 40-60 % of streaming throughput here (RELIABILITY_PERF.md A.2) and
cancels every stream on uvicorn's exit by itself, which defeats a graceful drain.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

from starlette.types import Message, Receive, Scope, Send

from server.core.errors import EngineError, GatewayError
from server.core.types import Delta, GenerationEvent

logger = logging.getLogger("gateway.http")

SSE_TYPE = "text/event-stream"
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse_event(payload: bytes) -> bytes:
    """One SSE event: `data: <payload>` and a blank line (every client accepts the space)."""
    return b"data: " + payload + b"\n\n"


class Events(Protocol):
    """A started request's events (one request or a batch), closed exactly once."""

    def __aiter__(self) -> AsyncIterator[GenerationEvent]: ...

    async def aclose(self) -> None: ...


class StreamFormat(Protocol):
    """How one protocol writes a stream. Any method may raise; the driver copes."""

    def encode(self, event: GenerationEvent) -> bytes:
        """The bytes for one event (b"" for none)."""

    def error(self, exc: GatewayError) -> bytes:
        """The in-band error frame after the first byte, with any terminator the format has."""

    def end(self) -> bytes:
        """What follows the last event of a stream that ended well (`[DONE]`, or b"")."""


class EventStreamAnswer:
    """An ASGI response streaming `events` through `fmt`. `on_close(ok)` runs once at the end:
    `ok` is True when the stream ended well, False on an error or a disconnect."""

    def __init__(
        self,
        events: Events,
        fmt: StreamFormat,
        *,
        media_type: str = SSE_TYPE,
        headers: Mapping[str, str] | None = None,
        on_close: Callable[[bool], None] | None = None,
    ) -> None:
        self.status_code = 200
        if headers:
            raw = {"content-type": media_type, **STREAM_HEADERS, **headers}
            self.raw_headers = _encoded(raw)
        else:
            self.raw_headers = _head(media_type)
        self._events = events
        self._fmt = fmt
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        producer = asyncio.current_task()
        assert producer is not None
        watcher = producer.get_loop().create_task(_watch_disconnect(receive, producer))
        ok = False
        try:
            await send(
                {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
            )
            tail, ok = await self._pump(send)
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except OSError:
            ok = False  # the client went away: nothing left to send to
        except asyncio.CancelledError:
            if not (watcher.done() and not watcher.cancelled() and watcher.result()):
                raise
            producer.uncancel()  # our own watcher cancelled us: the client disconnected
            ok = False
        finally:
            watcher.cancel()
            # events read to their end (the core's streams say so) leave nothing to wait for
            # in aclose(), so nothing to shield from a cancel: no task per stream for it
            if getattr(self._events, "finished", False):
                await self._events.aclose()
            else:
                await asyncio.shield(self._events.aclose())
            if self._on_close is not None:
                self._on_close(ok)

    async def _pump(self, send: Send) -> tuple[bytes, bool]:
        """Send every event; returns the tail to send last and whether the stream ended well."""
        fmt = self._fmt
        try:
            async for event in self._events:
                chunk = fmt.encode(event)
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            return fmt.end(), True
        except OSError:
            raise
        except GatewayError as exc:
            return self._error(exc), False
        except Exception:
            logger.exception("a stream failed after its first byte")
            return self._error(EngineError("Internal error while streaming the response")), False

    def _error(self, exc: GatewayError) -> bytes:
        try:
            return self._fmt.error(exc)
        except Exception:
            logger.exception("a stream's error frame could not be written")
            return b""


_HEADS: dict[str, list[tuple[bytes, bytes]]] = {}


def _head(media_type: str) -> list[tuple[bytes, bytes]]:
    """A fresh copy of a stream's usual headers for `media_type` (encoded once per type)."""
    head = _HEADS.get(media_type)
    if head is None:
        head = _HEADS[media_type] = _encoded({"content-type": media_type, **STREAM_HEADERS})
    return list(head)


def _encoded(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in headers.items()]


async def _watch_disconnect(receive: Receive, producer: asyncio.Task[object]) -> bool:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            producer.cancel()
            return True


def token_pieces(delta: Delta, token_texts: Callable[[list[int]], list[str]]) -> list[str]:
    """The text of each token of `delta`, joining exactly to `delta.text`.

    vLLM merges several tokens into one delta when the consumer falls behind. Their own texts
    (from the logprobs, else decoded one by one) are used when they join to the delta's text;
    otherwise (a multi-byte character split across tokens, a held-back stop string) the whole
    text goes to the last token and the others get "".
    """
    ids = delta.token_ids
    if len(ids) <= 1:
        return [delta.text] * len(ids)
    if len(delta.logprobs) == len(ids):
        pieces = [entry.token for entry in delta.logprobs]
    else:
        pieces = token_texts(list(ids))
    if "".join(pieces) == delta.text:
        return pieces
    return [""] * (len(ids) - 1) + [delta.text]
