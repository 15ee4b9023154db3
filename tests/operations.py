"""Every documented operation of every listener, read off the routes a gateway builds (an
in-process gateway on the fake engine): what the integration tests parametrize over."""

from __future__ import annotations

from dataclasses import dataclass

from tests.unit.gateway_kit import make_gateway


@dataclass(frozen=True, slots=True)
class Operation:
    listener: str
    method: str
    path: str  # as OpenAPI writes it: `{model:path}` is `{model}`
    body: bool  # takes a JSON body
    access: str  # the access class the route declares (open, data, metrics, admin)


def _operations() -> list[Operation]:
    found: dict[tuple[str, str, str], Operation] = {}
    for route in make_gateway().routes:
        if route.doc is None:
            continue
        path = route.path.replace("{model:path}", "{model}")
        for listener in sorted(route.listeners):
            key = (listener, route.method, path)
            found.setdefault(
                key,
                Operation(
                    listener, route.method, path, route.doc.body is not None, route.access.value
                ),
            )
    return sorted(found.values(), key=lambda op: (op.listener, op.path, op.method))


OPERATIONS = _operations()
