"""What a listener answers while the engine starts, before its routes exist: liveness paths
200 (the process is up), every other path a 503 with `Retry-After` in the shape of the protocol
that owns the path (`ProtocolSpec.paths`), else the listener's default owner's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from server.core.errors import ServiceUnavailable
from server.http.router import Router
from server.http.routes import Answer, Render, Route


async def _never(request: Request) -> Answer:  # pragma: no cover - matched, never called
    raise AssertionError("a start-up table only matches paths")


@dataclass(frozen=True, slots=True)
class PathOwner:
    """A protocol's path templates and its error renderer."""

    paths: frozenset[str]
    render: Render


class StartingAnswers:
    """Owners are asked in order; the first whose templates match a path renders its 503."""

    def __init__(
        self, owners: Sequence[PathOwner], *, default: Render, live: frozenset[str]
    ) -> None:
        self._tables = [(_table(owner), owner.render) for owner in owners if owner.paths]
        self._default = default
        self.live = live

    def render(self, path: str) -> Render:
        return next((render for table, render in self._tables if table.knows(path)),
                    self._default)

    def answer(self, path: str, state: str) -> Response:
        return self.render(path)(ServiceUnavailable(f"The service is {state}."))


def _table(owner: PathOwner) -> Router:
    routes = [
        Route(method="GET", path=path, endpoint=_never, owner="starting", render=owner.render)
        for path in sorted(owner.paths)
    ]
    return Router(routes, max_body_bytes=0)
