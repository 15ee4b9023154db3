"""The token event stream TGI's `/generate_stream` and MindIE's `/infer` share: one SSE event per
token (`data: <json>` and a blank line), no terminator, and the protocol's own error event after
the first byte."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from server.core.errors import GatewayError
from server.core.types import Delta, GenerationEvent
from server.http import jsonio
from server.http.streaming import sse_event


class TokenEventStream:
    """A `StreamFormat` writing each token of a delta as one SSE event.

    A subclass gives `plain` (the serialised event of a plain one-token delta, built without its
    dict: most events of a stream; None for any other delta) and `events` (the event dicts of
    any delta), and may handle the other events in `other`."""

    def __init__(self, stream_error: Callable[[GatewayError], bytes]) -> None:
        self._stream_error = stream_error

    def plain(self, delta: Delta) -> bytes | None:
        raise NotImplementedError

    def events(self, delta: Delta) -> Sequence[dict[str, Any]]:
        raise NotImplementedError

    def other(self, event: GenerationEvent) -> bytes:
        """The bytes for an event that is not a delta (none by default)."""
        return b""

    def encode(self, event: GenerationEvent) -> bytes:
        if not isinstance(event, Delta):
            return self.other(event)
        plain = self.plain(event)
        if plain is not None:
            return sse_event(plain)
        events = self.events(event)
        if len(events) == 1:  # one token per delta, as a rule
            return sse_event(jsonio.dumps(events[0]))
        return b"".join([sse_event(jsonio.dumps(e)) for e in events])

    def error(self, exc: GatewayError) -> bytes:
        return self._stream_error(exc)

    def end(self) -> bytes:
        return b""
