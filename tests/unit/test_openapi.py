"""The OpenAPI description agrees with the routes each listener really serves: it is built
from them, so what is checked here is that every route carries its description."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis

from server.http.routes import LISTENERS
from tests.unit.gateway_kit import client, make_gateway

pytestmark = pytest.mark.anyio


def undocumented_ok(method: str, path: str) -> bool:
    """DJL's adapter paths take every method and answer 405 to those they do not serve."""
    return "/adapters" in path


async def document(listener: str) -> dict[str, Any]:
    async with client(make_gateway()) as http:
        response = await http.get("/openapi.json", params={"listener": listener})
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


def test_every_route_but_djls_extra_methods_is_documented() -> None:
    missing = [
        (route.method, route.path)
        for route in make_gateway().routes
        if route.doc is None and not undocumented_ok(route.method, route.path)
    ]
    assert not missing


@pytest.mark.parametrize("listener", LISTENERS)
async def test_document_loads_as_openapi_3_1_with_every_operation(listener: str) -> None:
    doc = await document(listener)
    schema = schemathesis.openapi.from_dict(doc)
    operations = [result.ok() for result in schema.get_all_operations()]  # Err raises
    served = {
        (route.method, route.path.replace("{model:path}", "{model}"))
        for route in make_gateway().routes
        if listener in route.listeners and route.doc is not None
    }
    assert len(operations) == len(served)
    assert doc["servers"][0]["url"].startswith(("http://", "https://"))


async def test_bodies_come_from_the_wire_models() -> None:
    doc = await document("data")
    schemas = doc["components"]["schemas"]
    chat = schemas["openai.ChatCompletionRequest"]
    assert chat["properties"]["n"]["minimum"] == 1
    assert "messages" in chat["required"]
    assert {"kserve.InferRequest", "mindie.InferParameters", "tgi.GenerateRequest"} <= set(schemas)
    body = doc["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]
    assert len(body["schema"]["anyOf"]) == 2
    assert doc["paths"]["/generate"]["post"]["tags"] == ["shared"]


async def test_unknown_listener_is_a_400() -> None:
    async with client(make_gateway()) as http:
        response = await http.get("/openapi.json", params={"listener": "nope"})
    assert response.status_code == 400
