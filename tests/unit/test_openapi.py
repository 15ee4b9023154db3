"""The OpenAPI description agrees with the routes each listener really serves."""

from __future__ import annotations

import pytest
import schemathesis
from starlette.routing import Route

from server.gateway import listener_app
from server.openapi import LISTENERS, documented, openapi_document
from tests.unit.gateway_kit import make_gateway


def undocumented_ok(method: str, path: str) -> bool:
    """HEAD comes with GET; DJL's adapter paths take every method and answer 405 to the rest."""
    return method == "HEAD" or "/adapters" in path


def served(listener: str) -> set[tuple[str, str]]:
    app = listener_app(make_gateway(), (listener,))
    pairs = set()
    for route in app.routes:
        assert isinstance(route, Route)
        path = route.path.replace("{model:path}", "{model}")
        pairs |= {(method, path) for method in route.methods or ()}
    return pairs


@pytest.mark.parametrize("listener", LISTENERS)
def test_every_served_route_is_documented_and_nothing_else(listener: str) -> None:
    routes = served(listener)
    docs = set(documented(listener))
    missing = {(m, p) for m, p in routes - docs if not undocumented_ok(m, p)}
    assert not missing, f"served but not in server/openapi.py: {sorted(missing)}"
    assert docs <= routes, f"documented but not served: {sorted(docs - routes)}"


@pytest.mark.parametrize("listener", LISTENERS)
def test_document_loads_as_openapi_3_1_with_every_operation(listener: str) -> None:
    document = openapi_document(make_gateway().settings, listener)
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]  # Err raises
    assert len(operations) == len(list(documented(listener)))
    assert document["servers"][0]["url"].startswith(("http://", "https://"))


def test_bodies_come_from_the_wire_models() -> None:
    document = openapi_document(make_gateway().settings, "data")
    schemas = document["components"]["schemas"]
    chat = schemas["openai.ChatCompletionRequest"]
    assert chat["properties"]["n"]["minimum"] == 1
    assert "messages" in chat["required"]
    assert {"kserve.InferRequest", "mindie.InferParameters", "tgi.GenerateRequest"} <= set(schemas)
    body = document["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]
    assert len(body["schema"]["anyOf"]) == 2
