"""While the engine starts, each listener answers 503 in the shape of the protocol that owns
the path (server/http/starting.py, `ProtocolSpec.paths`), liveness 200."""

from __future__ import annotations

import re

import httpx
import pytest
from starlette.responses import Response

import protocols
from server.core.errors import GatewayError
from server.core.lifecycle import Lifecycle
from server.gateway import starting_answers
from server.http.routes import DATA, MANAGEMENT, METRICS
from server.http.starting import PathOwner, StartingAnswers
from server.runtime.process import StartingApp
from tests.unit.gateway_kit import make_gateway

pytestmark = pytest.mark.anyio


async def get(roles: tuple[str, ...], path: str, method: str = "GET") -> httpx.Response:
    app = StartingApp(Lifecycle(), starting_answers(roles))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        return await http.request(method, path)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"error": {"message": "The service is starting.",
                                            "type": "ServiceUnavailableError", "param": None,
                                            "code": 503}}),
        ("/health", {"error": "The service is starting.", "error_type": "unhealthy"}),
        ("/generate", {"error": "The service is starting.", "error_type": "unhealthy"}),
        ("/v2/models/tiny/infer", {"error": "The service is starting."}),
        ("/infer", {"error": "The service is starting.", "error_type": "Service Unavailable"}),
    ],
)
async def test_on_the_data_listener_the_owning_protocol_renders_the_503(
    path: str, body: dict[str, object]
) -> None:
    response = await get((DATA,), path, "POST")
    assert (response.status_code, response.json()) == (503, body)
    assert response.headers["retry-after"] == "5"


async def test_djl_paths_answer_in_djls_shape_and_liveness_is_200() -> None:
    djl = await get((DATA,), "/invocations", "POST")
    assert djl.status_code == 503
    assert djl.json()["type"] == "ServiceUnavailableException"
    assert (await get((DATA,), "/v2/health/live")).status_code == 200


async def test_the_management_and_metrics_listeners_answer_in_the_control_planes_shape() -> None:
    for roles in ((MANAGEMENT,), (METRICS,), (DATA, MANAGEMENT, METRICS)):
        response = await get(roles, "/v1/status")
        assert response.status_code == 503, roles
        assert response.json() == {"error": "The service is starting.",
                                   "error_type": "Service Unavailable"}


def test_every_protocol_declares_the_data_paths_it_answers_by_default() -> None:
    """`ProtocolSpec.paths` cannot drift from the routes: each data route without a body claim
    is one of its spec's paths, and each spec's paths serve a route of its own."""
    gateway = make_gateway(overrides={"ProtocolConfig": {"tgiCompat": True}})
    for spec in protocols.REGISTRY:
        owners = [PathOwner(spec.paths, spec.render)]
        owner = StartingAnswers(owners, default=_unowned, live=frozenset())
        served = [r for r in gateway.routes if r.owner == spec.name and DATA in r.listeners]
        for route in served:
            if route.claim is None:
                assert owner.render(_example(route.path)) is spec.render, route.path
        assert spec.paths or not served


def _unowned(exc: GatewayError) -> Response:
    raise AssertionError(exc)


def _example(template: str) -> str:
    """A concrete path for a route template."""
    return re.sub(r"{[^}]+}", "x", template)
