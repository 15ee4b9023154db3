"""The one error-table mechanism every protocol renders domain errors with.

A table maps domain error classes (server/core/errors.py, or a protocol's own subclasses) to
that protocol's row (status, type names, whatever its envelope needs). A lookup walks the
error's MRO and takes the closest class that has a row, as Starlette's exception handlers do: a
new subclass inherits its parent's row, and the order rows are written in does not matter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

from server.core.errors import GatewayError

Row = TypeVar("Row")
_UNRESOLVED = object()


class ErrorTable(Generic[Row]):
    """Domain error class → row, looked up along the MRO; `default` for an error no class of
    whose MRO has a row (a `GatewayError` row serves as the default too)."""

    def __init__(self, rows: Mapping[type[GatewayError], Row], *, default: Row) -> None:
        self._rows = dict(rows)
        self._default = default
        self._resolved: dict[type[BaseException], Row] = {}

    def __getitem__(self, exc: GatewayError) -> Row:
        kind = type(exc)
        row = self._resolved.get(kind, _UNRESOLVED)
        if row is _UNRESOLVED:
            row = self._resolved[kind] = self._lookup(kind)
        return row  # type: ignore[return-value]

    def _lookup(self, kind: type[BaseException]) -> Row:
        for cls in kind.__mro__:
            if cls in self._rows:
                return self._rows[cls]
        return self._default
