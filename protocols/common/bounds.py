"""The request bounds every protocol checks the same way (server/http/context.py `RequestBounds`):
stop strings and the number of new tokens.
"""

from __future__ import annotations

from server.core.errors import InvalidRequest
from server.http.context import RequestBounds


def stop_strings(
    stop: str | list[str] | None, bounds: RequestBounds, *, param: str = "stop"
) -> tuple[str, ...]:
    """`param`: the field's name on the wire (OpenAI's `stop`, Anthropic's `stop_sequences`)."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > bounds.max_stop_sequences:
        raise InvalidRequest(
            f"At most {bounds.max_stop_sequences} stop sequences are allowed, got {len(stops)}.",
            param=param,
        )
    for item in stops:
        if not item:
            raise InvalidRequest(f"{param} cannot contain an empty string.", param=param)
        if len(item) > bounds.max_stop_length:
            raise InvalidRequest(
                f"Each stop sequence may have at most {bounds.max_stop_length} characters.",
                param=param,
            )
    return stops


def bounded_max_tokens(requested: int | None, bounds: RequestBounds) -> int | None:
    cap = bounds.max_new_tokens
    if requested is not None and cap is not None and requested > cap:
        raise InvalidRequest(
            f"max_tokens must be at most {cap}, got {requested}.", param="max_tokens"
        )
    return requested
