"""Anchor request fields the engine port does not carry: accepted at the anchor's default (what a
client that never sets them sends) and refused otherwise, never dropped (docs/protocols.md,
"Request fields: applied or refused")."""

from __future__ import annotations

from collections.abc import Mapping

from server.core.errors import Unsupported

Neutral = Mapping[str, tuple[object, ...]]  # field → the values that ask for nothing


def refuse_unserved(given: Mapping[str, object], fields: Neutral, *, prefix: str = "") -> None:
    """Unsupported (the protocol's 4xx) for the first of `fields` that `given` sets to
    something other than a neutral value."""
    for name, neutral in fields.items():
        if name in given and not any(_same(given[name], value) for value in neutral):
            raise Unsupported(
                f"`{prefix}{name}` is not supported by this server.", param=f"{prefix}{name}"
            )


def _same(given: object, neutral: object) -> bool:
    if isinstance(given, bool) or isinstance(neutral, bool) or given is None or neutral is None:
        return given is neutral
    return given == neutral
