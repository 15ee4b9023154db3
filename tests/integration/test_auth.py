"""Bearer credentials on every route of every protocol (server/http/auth.py, B.7 #21-#23).

A fake-engine server with two API keys and one admin key. Every documented operation (the
OpenAPI route table) is called without a key, with a wrong key, with an API key and with the
admin key: inference and information routes want any key, control and adapter management routes
the admin key, the health family nothing. Refusals are 401 in the route's own protocol envelope
with `WWW-Authenticate: Bearer`. The Host header and other tricks cannot move the decision off
the path the router dispatches on (CVE-2026-48710/48746). The official clients pass their keys.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from tritonclient.http import InferenceServerClient

from server.http import auth
from server.http.auth import Keyring
from server.http.routes import Access
from tests.integration.traffic import management_client
from tests.operations import OPERATIONS, Operation
from tests.serverproc import RunningServer, running_server

API_KEYS = ["sk-data-one", "sk-data-two-longer"]
ADMIN_KEY = "sk-admin-only"
# Path values that keep the calls harmless: no such adapter, no such role.
PATH_VALUES = {"model": "tiny", "version": "1", "name": "no-such-adapter", "role": "no-role",
               "seconds": "5"}
NEVER_AUTHORIZED = {"/stopService"}  # with the admin key it would stop the server


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    overrides = {"SecurityConfig": {"apiKeys": API_KEYS, "adminKeys": [ADMIN_KEY]}}
    folder = tmp_path_factory.mktemp("auth")
    with running_server(folder, engine="fake", overrides=overrides, ready_timeout=60) as server:
        yield server
        assert_serving(server)


def assert_serving(server: RunningServer) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "ok", "max_tokens": 1},
        headers=bearer(API_KEYS[0]), timeout=30,
    )
    assert response.status_code == 200, response.text
    with management_client(server, headers=bearer(ADMIN_KEY), timeout=30) as http:
        status = http.get("/v1/status")
    assert status.status_code == 200
    assert status.json()["gateway"]["inflight"] == 0
    assert status.json()["gateway"]["state"] == "ready"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def concrete(path: str) -> str:
    for name, value in PATH_VALUES.items():
        path = path.replace("{" + name + "}", value)
    return path


# The health family, written out here rather than read from the routes: the test's own list of
# what load balancers and kubelets may probe without credentials.
OPEN_PATHS = frozenset({
    "/", "/health", "/ping", "/v2/health/live", "/v2/health/ready", "/v2/models/{model}/ready",
    "/v2/models/{model}/versions/{version}/ready", "/health/timed", "/health/timed-{seconds}",
})


def is_open(op: Operation) -> bool:
    return op.path in OPEN_PATHS and (op.method == "GET" or op.path == "/ping")


def is_admin(op: Operation) -> bool:
    admin_paths = {o.path for o in OPERATIONS if o.listener == "management"} - OPEN_PATHS
    admin_paths -= {"/metrics", "/metrics-json", "/v2/models/{model}/getSlotCount",
                    "/v2/models/{model}/versions/{version}/getSlotCount"}
    return op.path in admin_paths


GUARDED = [op for op in OPERATIONS if not is_open(op)]
OPEN = [op for op in OPERATIONS if is_open(op)]


@pytest.mark.parametrize("op", OPERATIONS, ids=lambda op: f"{op.listener}:{op.method}:{op.path}")
def test_every_route_declares_the_access_class_this_test_expects(op: Operation) -> None:
    expected = "open" if is_open(op) else "admin" if is_admin(op) else None
    if expected is None:
        expected = "metrics" if op.path.startswith("/metrics") else "data"
    assert op.access == expected


def call(server: RunningServer, op: Operation, headers: dict[str, str]) -> httpx.Response:
    body: Any = {} if op.body is not None else None
    if op.listener == "management":
        with management_client(server, timeout=30) as http:
            return http.request(op.method, concrete(op.path), json=body, headers=headers)
    base = server.url if op.listener == "data" else server.metrics_url
    return httpx.request(
        op.method, base + concrete(op.path), json=body, headers=headers, timeout=30
    )


def op_id(op: Operation) -> str:
    return f"{op.listener}:{op.method}:{op.path}"


# ---- every route ----------------------------------------------------------------------------
@pytest.mark.parametrize("op", GUARDED, ids=op_id)
def test_route_without_a_key_is_401_in_its_protocol_envelope(
    keyed: RunningServer, op: Operation
) -> None:
    response = call(keyed, op, {})
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()  # a JSON error body of the route's protocol


@pytest.mark.parametrize("op", GUARDED, ids=op_id)
def test_route_with_a_wrong_key_is_401(keyed: RunningServer, op: Operation) -> None:
    for wrong in ("sk-data-on", API_KEYS[0].upper(), f"{API_KEYS[0]}x", "x" * 4096, ADMIN_KEY[:-1]):
        response = call(keyed, op, bearer(wrong))
        assert response.status_code == 401, (wrong, response.text)
        assert response.headers["www-authenticate"] == 'Bearer error="invalid_token"'


@pytest.mark.parametrize("op", GUARDED, ids=op_id)
def test_each_route_opens_to_its_own_class_of_key(keyed: RunningServer, op: Operation) -> None:
    if op.path in NEVER_AUTHORIZED:
        pytest.skip("authorized, it would stop the server")
    with_api_key = call(keyed, op, bearer(API_KEYS[1]))
    with_admin_key = call(keyed, op, bearer(ADMIN_KEY))
    assert with_admin_key.status_code != 401, with_admin_key.text
    if is_admin(op):
        assert with_api_key.status_code == 401, "an API key must not open a control route"
    else:
        assert with_api_key.status_code != 401, with_api_key.text


@pytest.mark.parametrize("op", OPEN, ids=op_id)
def test_health_family_stays_open(keyed: RunningServer, op: Operation) -> None:
    assert call(keyed, op, {}).status_code == 200


def test_refusals_use_each_protocols_envelope(keyed: RunningServer) -> None:
    url = keyed.url
    chat = httpx.post(f"{url}/v1/chat/completions", json={}, timeout=30).json()
    assert chat["error"]["type"] == "AuthenticationError"
    assert chat["error"]["code"] == 401
    tgi = httpx.post(f"{url}/generate_stream", json={}, timeout=30).json()
    assert tgi["error_type"] == "authentication"
    kserve = httpx.post(f"{url}/v2/models/tiny/infer", json={}, timeout=30).json()
    assert set(kserve) == {"error"}
    mindie = httpx.post(f"{url}/infer", json={}, timeout=30).json()
    assert mindie["error_type"] == "Unauthorized"
    with management_client(keyed, timeout=30) as http:
        control = http.get("/v1/status").json()
    assert control["error_type"] == "Unauthorized"


# ---- the decision is taken on the routed path (B.7 #22) ----------------------------------------
def raw_status(port: int, head: str) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode("latin-1"))
        answer = b""
        while b"\r\n" not in answer and (chunk := sock.recv(4096)):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


CONFUSIONS = {
    "host-with-path": "GET /v1/models HTTP/1.1\r\nHost: a/health?x=\r\n\r\n",
    "host-with-path-post": (
        "POST /v1/completions HTTP/1.1\r\nHost: x/health?\r\ncontent-type: application/json\r\n"
        'content-length: 32\r\n\r\n{"prompt": "x", "max_tokens": 1}'
    ),
    "absolute-form-target": "GET http://127.0.0.1/v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    "rewrite-headers": (
        "GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Original-URL: /health\r\n"
        "X-Rewrite-URL: /health\r\nX-Forwarded-Prefix: /health\r\n\r\n"
    ),
    "percent-encoded": "GET /v1/%6Dodels HTTP/1.1\r\nHost: x\r\n\r\n",
    "dot-segments": "GET /health/../v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    "double-slash": "GET //v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    "websocket-upgrade": (
        "GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    ),
    "query-with-health": "GET /v1/models?/health HTTP/1.1\r\nHost: x\r\n\r\n",
    "basic-scheme": "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Basic c2s=\r\n\r\n",
    "bearer-in-lower-header-twice": (
        "GET /v1/models HTTP/1.1\r\nHost: x\r\nauthorization: Bearer nope\r\n"
        f"authorization: Bearer {API_KEYS[0]}\r\n\r\n"
    ),
}


@pytest.mark.parametrize("case", sorted(CONFUSIONS))
def test_host_header_and_path_tricks_do_not_bypass_auth(keyed: RunningServer, case: str) -> None:
    assert raw_status(keyed.data_port, CONFUSIONS[case]) == 401


def test_bearer_scheme_is_case_insensitive_but_the_key_is_exact(keyed: RunningServer) -> None:
    headers = {"authorization": f"bearer {API_KEYS[0]}"}
    assert httpx.get(f"{keyed.url}/v1/models", headers=headers, timeout=30).status_code == 200
    upper = {"authorization": f"Bearer {API_KEYS[0].upper()}"}
    assert httpx.get(f"{keyed.url}/v1/models", headers=upper, timeout=30).status_code == 401


# ---- constant-time comparison (B.7 #21, CVE-2025-59425) ---------------------------------------
def test_every_key_is_compared_as_a_digest_with_no_early_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compared: list[tuple[bytes, bytes]] = []

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keyring = Keyring(API_KEYS, [ADMIN_KEY])
    for token in (API_KEYS[0].encode(), b"wrong", b"x" * 10_000):
        compared.clear()
        keyring.allows(Access.DATA, token)
        assert len(compared) == 3  # both API keys and the admin key, whichever matched
        assert all(len(a) == len(b) == 32 for a, b in compared)  # SHA-256: no length leak
        assert compared[0][0] == hashlib.sha256(token).digest()


def test_keyring_classes() -> None:
    keyring = Keyring(API_KEYS, [ADMIN_KEY])
    data, admin = Access.DATA, Access.ADMIN
    assert keyring.allows(data, API_KEYS[0].encode())
    assert keyring.allows(data, ADMIN_KEY.encode())
    assert not keyring.allows(admin, API_KEYS[0].encode())
    assert keyring.allows(admin, ADMIN_KEY.encode())
    assert not keyring.allows(data, None)
    assert keyring.allows(Access.OPEN, None)
    only_api = Keyring(API_KEYS, [])
    assert only_api.allows(admin, API_KEYS[1].encode())  # as vLLM guards its LoRA routes
    assert Keyring([], []).allows(admin, None)  # no keys: the listener's mTLS is the guard


# ---- official clients ---------------------------------------------------------------------------
def test_openai_sdk_passes_its_api_key(keyed: RunningServer) -> None:
    good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=API_KEYS[0], max_retries=0)
    reply = good.completions.create(model="tiny", prompt="hello world", max_tokens=2)
    assert reply.choices[0].text == "hello world "
    bad = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hello", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_anthropic_sdk_passes_its_key_as_bearer_or_x_api_key(keyed: RunningServer) -> None:
    """Current SDKs send `Authorization: Bearer`; older ones and many agents `x-api-key`."""
    user = [{"role": "user", "content": "hello world"}]
    good = anthropic.Anthropic(base_url=keyed.url, api_key=API_KEYS[0], max_retries=0)
    assert good.messages.create(model="tiny", max_tokens=2, messages=user).usage.output_tokens
    old_style = httpx.post(
        f"{keyed.url}/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": user},
        headers={"x-api-key": API_KEYS[1], "anthropic-version": "2023-06-01"}, timeout=30,
    )
    assert old_style.status_code == 200, old_style.text
    bad = anthropic.Anthropic(base_url=keyed.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        bad.messages.create(model="tiny", max_tokens=2, messages=user)
    assert refused.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": "An API key was not accepted for this route."}}
    wrong = httpx.post(f"{keyed.url}/v1/messages/count_tokens",
                       json={"model": "tiny", "messages": user},
                       headers={"x-api-key": "sk-wrong"}, timeout=30)
    assert wrong.status_code == 401 and wrong.headers["request-id"]


def test_huggingface_hub_client_passes_its_token(keyed: RunningServer) -> None:
    client = InferenceClient(base_url=keyed.url, token=API_KEYS[1])
    assert client.text_generation("hello there", max_new_tokens=2)
    refused = InferenceClient(base_url=keyed.url, token="hf_wrong")
    with pytest.raises(Exception, match="not accepted"):
        refused.text_generation("hello there", max_new_tokens=2)


def test_tritonclient_passes_its_header(keyed: RunningServer) -> None:
    client = InferenceServerClient(url=f"127.0.0.1:{keyed.data_port}")
    assert client.is_model_ready("tiny", headers=bearer(API_KEYS[0]))
    assert client.get_model_metadata("tiny", headers=bearer(API_KEYS[0]))["name"] == "tiny"
    with pytest.raises(Exception, match="API key is required"):
        client.get_model_metadata("tiny")
    client.close()


def test_model_paths_show_in_v1_models_only_to_admin_callers(keyed: RunningServer) -> None:
    def roots(key: str) -> dict[str, str]:
        response = httpx.get(f"{keyed.url}/v1/models", headers=bearer(key), timeout=30)
        assert response.status_code == 200
        return {m["id"]: m["root"] for m in response.json()["data"]}

    assert roots(API_KEYS[0]) == {name: name for name in roots(API_KEYS[0])}
    admin = roots(ADMIN_KEY)
    assert admin["tiny"].startswith("/")  # the engine's model path
    assert admin["a1"].endswith("adapters/a1")
