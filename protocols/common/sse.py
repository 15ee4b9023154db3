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

    A subclass gives `events` (the event dicts of any delta) and may handle the other events in
    `other`. Its `encode` usually answers the plain one-token deltas of a stream (most events)
    itself, as bytes from a template, and hands the rest to `general`."""

    def __init__(self, stream_error: Callable[[GatewayError], bytes]) -> None:
        self._stream_error = stream_error

    def events(self, delta: Delta) -> Sequence[dict[str, Any]]:
        raise NotImplementedError

    def other(self, event: GenerationEvent) -> bytes:
        """The bytes for an event that is not a delta (none by default)."""
        return b""

    def encode(self, event: GenerationEvent) -> bytes:
        if not isinstance(event, Delta):
            return self.other(event)
        return self.general(event)

    def general(self, delta: Delta) -> bytes:
        """Any delta, through its event dicts."""
        events = self.events(delta)
        if len(events) == 1:  # one token per delta, as a rule
            return sse_event(jsonio.dumps(events[0]))
        return b"".join([sse_event(jsonio.dumps(e)) for e in events])

    def error(self, exc: GatewayError) -> bytes:
        return self._stream_error(exc)

    def end(self) -> bytes:
        return b""
