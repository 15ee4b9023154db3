"""The listener app (server/http/app.py, router.py): routing decided once from the specs, and
the one ASGI layer around it (request id, drain, body limit, credentials, metrics)."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from server.core.errors import GatewayError
from server.http.router import RouteClash, Router, has_key
from server.http.routes import Access, Answer, Route
from tests.unit.gateway_kit import client, make_gateway

pytestmark = pytest.mark.anyio
KEYS = {"SecurityConfig": {"apiKeys": ["sk-api"], "adminKeys": ["sk-admin"]}}


def said(text: str) -> Any:
    async def endpoint(request: Request) -> Answer:
        return PlainTextResponse(text)

    return endpoint


def render(exc: GatewayError) -> Response:
    return PlainTextResponse(exc.message, 400)


def route(owner: str, path: str = "/x", **options: Any) -> Route:
    return Route(method="POST", path=path, endpoint=said(owner), owner=owner, render=render,
                 **options)


# ---- routing decided once -------------------------------------------------------------------
def test_one_path_claimed_twice_fails_at_build_naming_both_owners() -> None:
    with pytest.raises(RouteClash, match="POST /x is claimed by a, b"):
        Router([route("a"), route("b")], max_body_bytes=1024)


def test_parameter_names_do_not_hide_a_clash() -> None:
    with pytest.raises(RouteClash):
        Router([route("a", "/m/{model}"), route("b", "/m/{name}")], max_body_bytes=1024)


def test_an_override_settles_a_shared_path() -> None:
    router = Router([route("a"), route("b", overrides=frozenset({"a"}))], max_body_bytes=1024)
    entry = router.resolve("POST", "/x").entry
    assert entry is not None and entry.owner == "b"


async def test_body_claims_dispatch_a_shared_path() -> None:
    gateway = make_gateway()
    async with client(gateway, "data") as http:
        mindie = await http.post("/generate", json={"prompt": "a b", "max_tokens": 2})
        tgi = await http.post("/generate", json={"inputs": "a b",
                                                 "parameters": {"max_new_tokens": 2}})
        broken = await http.post("/generate", content=b"{nope")
    assert set(mindie.json()) == {"text"}  # MindIE's vLLM flavour
    assert "generated_text" in tgi.json()
    assert broken.status_code == 422 and broken.json()["error_type"] == "validation"  # TGI's
    counts = gateway.metrics.http_requests
    assert counts.labels("mindie", "/generate", "200").value == 1
    assert counts.labels("tgi", "/generate", "200").value == 1


def test_every_listener_of_the_real_registry_builds_without_clashes() -> None:
    gateway = make_gateway()
    for roles in (("data",), ("management",), ("metrics",), ("data", "management", "metrics")):
        gateway.app(roles)


# ---- answers for what no route serves ---------------------------------------------------------
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
async def test_an_unknown_path_on_the_data_listener_is_vllms_json_404(method: str) -> None:
    """vLLM's FastAPI app: Starlette's router raises its 404, FastAPI's default handler answers
    `{"detail": "Not Found"}` (vLLM's own error shape is registered for FastAPI's subclass)."""
    async with client(make_gateway(), "data") as http:
        for path in ("/nope", "/v1/nope", "/v2/models/tiny/nope", "/v1/completions/x"):
            missing = await http.request(method, path)
            assert missing.status_code == 404, path
            assert missing.headers["content-type"] == "application/json"
            assert missing.content == b'{"detail":"Not Found"}'
            assert "allow" not in missing.headers


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("GET", "/v1/completions", "POST"), ("DELETE", "/v1/chat/completions", "POST"),
     ("PUT", "/v1/models", "GET, HEAD"), ("POST", "/v1/responses/resp_1", "GET, HEAD"),
     ("PATCH", "/generate", "POST")],
)
async def test_a_wrong_method_on_the_data_listener_is_vllms_json_405_with_allow(
    method: str, path: str, allow: str
) -> None:
    async with client(make_gateway(), "data") as http:
        wrong = await http.request(method, path)
    assert wrong.status_code == 405
    assert wrong.headers["content-type"] == "application/json"
    assert wrong.content == b'{"detail":"Method Not Allowed"}'
    assert wrong.headers["allow"] == allow  # the gateway serves HEAD wherever it serves GET


async def test_a_path_known_without_its_trailing_slash_redirects_as_starlettes_router() -> None:
    async with client(make_gateway(), "data") as http:
        head = await http.head("/v1/models")
        slash = await http.post("/v1/completions/?x=1", json={})
        unslashed = await http.get("/v2/health/live/")
    assert head.status_code == 200 and head.content == b""
    assert slash.status_code == 307 and slash.content == b""
    assert slash.headers["location"] == "http://gateway/v1/completions?x=1"
    assert unslashed.status_code == 307
    assert unslashed.headers["location"] == "http://gateway/v2/health/live"


async def test_an_empty_path_parameter_names_nothing() -> None:
    """`/v1/models/` is the listing with a slash (a redirect, as vLLM's router answers), not a
    model named "" (it was a 200 with `"id": ""`)."""
    async with client(make_gateway(), "data") as http:
        listing = await http.get("/v1/models/")
        adapters = await http.get("/adapters/")
    assert listing.status_code == 307
    assert listing.headers["location"] == "http://gateway/v1/models"
    assert adapters.status_code == 307
    assert adapters.headers["location"] == "http://gateway/adapters"


@pytest.mark.parametrize("listener", ["management", "metrics"])
async def test_unknown_path_on_the_management_and_metrics_listeners_is_mindies_404(
    listener: str,
) -> None:
    async with client(make_gateway(), listener) as http:
        missing = await http.get("/nope")
        wrong = await http.post("/metrics")
    assert missing.status_code == 404
    assert missing.json()["error"] == "No route /nope on this listener."  # names no listener
    assert wrong.status_code == 405 and wrong.json()["error_type"] == "Method Not Allowed"


# ---- the ASGI layer -----------------------------------------------------------------------------
async def test_request_id_is_echoed_or_made() -> None:
    async with client(make_gateway(), "data") as http:
        given = await http.get("/v1/models", headers={"x-request-id": "abc-1"})
        made = await http.get("/v1/models")
    assert given.headers["x-request-id"] == "abc-1"
    assert len(made.headers["x-request-id"]) == 32


async def test_every_answer_says_connection_close_while_draining() -> None:
    gateway = make_gateway()
    async with client(gateway, "data") as http:
        assert "connection" not in (await http.get("/v1/models")).headers
        gateway.shutdown.request()
        assert (await http.get("/v1/models")).headers["connection"] == "close"


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/v1/completions", "error"), ("/generate_stream", "error_type"), ("/infer", "error_type")],
)
async def test_a_declared_body_over_the_limit_is_413_in_the_routes_shape(
    path: str, shape: str
) -> None:
    gateway = make_gateway(overrides={"ServerConfig": {"maxRequestLength": 1}})
    async with client(gateway, "data") as http:
        response = await http.post(path, content=b"x" * (1024 * 1024 + 1))
    assert response.status_code == 413 and shape in response.json()


async def test_a_chunked_body_over_the_limit_is_413() -> None:
    gateway = make_gateway(overrides={"ServerConfig": {"maxRequestLength": 1}})

    async def chunks() -> Any:
        for _ in range(3):
            yield b"x" * (512 * 1024)

    async with client(gateway, "data") as http:
        response = await http.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
    assert response.status_code == 413


# ---- credentials --------------------------------------------------------------------------------
async def test_without_a_key_inference_is_401_in_its_protocols_envelope() -> None:
    async with client(make_gateway(overrides=KEYS), "data") as http:
        openai = await http.post("/v1/completions", json={"prompt": "a"})
        tgi = await http.post("/generate_stream", json={"inputs": "a"})
        unknown = await http.get("/nope")
    assert openai.status_code == tgi.status_code == unknown.status_code == 401
    assert openai.headers["www-authenticate"] == "Bearer"
    assert openai.json()["error"]["type"] == "AuthenticationError"
    assert tgi.json()["error_type"] == "authentication"


async def test_keys_open_their_own_class_of_route() -> None:
    api, admin = {"authorization": "Bearer sk-api"}, {"authorization": "Bearer sk-admin"}
    wrong = {"authorization": "Bearer sk-ap"}
    async with client(make_gateway(overrides=KEYS), "data") as http:
        assert (await http.get("/v1/models", headers=api)).status_code == 200
        assert (await http.get("/v1/models", headers=admin)).status_code == 200
        refused = await http.get("/v1/models", headers=wrong)
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == 'Bearer error="invalid_token"'
        lora = {"lora_name": "x"}
        assert (await http.post("/v1/unload_lora_adapter", json=lora, headers=api)
                ).status_code == 401
        assert (await http.post("/v1/unload_lora_adapter", json=lora, headers=admin)
                ).status_code == 404
        assert (await http.get("/health")).status_code == 200  # open: no key
        assert (await http.get("/nope", headers=api)).status_code == 404
    async with client(make_gateway(overrides=KEYS), "metrics") as http:
        assert (await http.get("/metrics")).status_code == 401
        assert (await http.get("/metrics", headers=api)).status_code == 200


def test_route_access_classes_are_declared_not_guessed() -> None:
    routes = {(r.method, r.path, frozenset(r.listeners)): r.access for r in make_gateway().routes}
    assert routes[("GET", "/health", frozenset({"data"}))] is Access.OPEN
    assert routes[("GET", "/health", frozenset({"management"}))] is Access.OPEN
    assert routes[("GET", "/stopService", frozenset({"management"}))] is Access.ADMIN
    assert routes[("POST", "/v1/completions", frozenset({"data"}))] is Access.DATA


def test_has_key_claims_only_objects_with_a_non_null_key() -> None:
    claim = has_key("prompt")
    assert claim({"prompt": "x"}) and not claim({"prompt": None}) and not claim(["prompt"])
