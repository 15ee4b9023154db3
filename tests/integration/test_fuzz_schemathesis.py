"""Schemathesis over the OpenAPI description of every listener (server/openapi.py, B.7 #28).

The description is fetched from the running server (`GET /openapi.json` on the management
listener, over mTLS). Two runs, at least 2,000 generated cases in all, each case one HTTP request:

- the real engine (`live_server`): every data-listener operation and the read-only management
  operations, with schema-valid bodies whose token counts are bounded (`max_tokens` ≤ 4, `n` ≤ 2,
  the length fields required) so generations stay short on a CPU;
- a fake-engine server: every operation but `/stopService` and the role switches (deliberate
  control actions), with schema-valid *and* schema-violating cases (schemathesis' negative mode).

The only check is the one the issue asks for: no 5xx and no hang (a 60 s request timeout fails
the case). Afterwards both servers still serve and nothing is in flight.
"""

from __future__ import annotations

import contextlib
import copy
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.checks import not_a_server_error

from tests.integration.traffic import management_client
from tests.serverproc import CERTS, RunningServer, running_server

LIVE_CASES_PER_OPERATION = 40
FAKE_CASES_PER_OPERATION = 20
TIMEOUT_S = 60
COUNTS: dict[str, int] = {"live": 0, "fake": 0}
FINISHED: set[str] = set()  # node ids of this module's tests that ran (totals need them all)
STATUSES: dict[tuple[str, str, int], int] = {}  # (run, method, status) → cases

TOKEN_FIELDS = {"max_tokens", "max_new_tokens", "max_completion_tokens", "min_tokens",
                "min_new_tokens"}
SMALL_FIELDS = {"n", "best_of", "top_n_tokens", "top_logprobs", "logprobs", "prompt_logprobs"}
REQUIRED_CAPS = {  # schema → the field that caps its generation
    "openai.ChatCompletionRequest": "max_tokens",
    "openai.CompletionRequest": "max_tokens",
    "tgi.Parameters": "max_new_tokens",
    "tgi.GenerateRequest": "parameters",
    "mindie.InferParameters": "max_new_tokens",
    "mindie.VllmGenerateRequest": "max_tokens",
    "djl.LmiParameters": "max_new_tokens",
    "djl.LmiRequest": "parameters",
}
CAPS = {"max_tokens", "max_new_tokens"}
# Writes that would change the shared real server for the other test modules.
LIVE_EXCLUDED_PATHS = ("/stopService", "/v1/role/", "/v2/role/", "/v1/load_lora_adapter",
                       "/v1/unload_lora_adapter")
FAKE_EXCLUDED_PATHS = ("/stopService", "/v1/role/", "/v2/role/")


# ---- schemas --------------------------------------------------------------------------------
def fetch_document(server: RunningServer, listener: str) -> dict[str, Any]:
    with management_client(server, timeout=30) as http:
        response = http.get("/openapi.json", params={"listener": listener})
    response.raise_for_status()
    document: dict[str, Any] = response.json()
    return document


# Fields that (almost) always make a request a 400 here, or (beam search) a long one; dropped
# from the live run's schema so that more cases reach the engine (the fake-engine run still
# fuzzes them, negative mode too).
ALWAYS_REFUSED = {"chat_template", "prompt_embeds", "tools", "tool_choice", "logit_bias",
                  "bad_words", "allowed_token_ids", "typical_p", "num_beams", "use_beam_search",
                  "length_penalty", "early_stopping"}


def bounded(document: dict[str, Any]) -> dict[str, Any]:
    """Cap generation sizes so a valid case is a short generation on the CPU."""
    document = copy.deepcopy(document)
    _cap(document)
    schemas = document.get("components", {}).get("schemas", {})
    for schema in schemas.values():
        for name in ALWAYS_REFUSED & set(schema.get("properties", {})):
            del schema["properties"][name]
    for name, field in REQUIRED_CAPS.items():
        if name in schemas:
            schemas[name].setdefault("required", []).append(field)
    for path in document["paths"].values():
        for operation in path.values():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            props = (body or {}).get("schema", {}).get("properties", {})
            if "text_input" in props:  # Triton generate: parameters only through known keys
                props["parameters"] = {"type": "object", "additionalProperties": False}
                body["schema"]["required"] = ["text_input", "max_tokens"]
                body["schema"]["additionalProperties"] = False
    return document


def _cap(node: Any) -> None:
    if isinstance(node, dict):
        for key, value in node.get("properties", {}).items():
            _cap_field(key, value)
        if node.get("type") == "array":
            node.setdefault("maxItems", 4)
        if node.get("type") == "string":
            node.setdefault("maxLength", 64)
        for value in node.values():
            _cap(value)
    elif isinstance(node, list):
        for value in node:
            _cap(value)


SERVED = ["tiny", "a1", "a2", "a3"]
MODEL_FIELDS = {"model", "adapter_id", "lora_name"}  # so most valid cases reach the engine


def _cap_field(name: str, schema: Any) -> None:
    if name in MODEL_FIELDS and isinstance(schema, dict):
        schema.clear()
        schema.update({"anyOf": [{"enum": SERVED}, {"type": "null"}]})
        return
    limit = 4 if name in TOKEN_FIELDS else 2 if name in SMALL_FIELDS else None
    if name == "timeout":  # MindIE seconds: a client deadline that expires is not a crash
        limit = None
        for option in _options(schema):
            option.update({"minimum": 60, "maximum": 600})
    if limit is not None:
        for option in _options(schema):
            if option.get("type") == "integer":
                option["maximum"] = limit
                option["minimum"] = max(option.get("minimum", 0), 0 if name != "n" else 1)
    if name in CAPS and isinstance(schema, dict) and "anyOf" in schema:
        # null would mean "the rest of the context": hundreds of tokens on a CPU
        schema["anyOf"] = [o for o in schema["anyOf"] if o.get("type") == "integer"]


def _options(schema: Any) -> list[dict[str, Any]]:
    if not isinstance(schema, dict):
        return []
    return [schema, *[o for o in schema.get("anyOf", []) if isinstance(o, dict)]]


# ---- running cases ------------------------------------------------------------------------------
def run_cases(
    strategy: st.SearchStrategy[Case],
    *,
    base_url: str,
    examples: int,
    run: str,
) -> None:
    tls = base_url.startswith("https")
    session = requests.Session()
    extra: dict[str, Any] = (
        {"verify": str(CERTS / "ca.pem"), "cert": (str(CERTS / "client.pem"),
                                                    str(CERTS / "client.key"))}
        if tls else {}
    )

    @settings(
        max_examples=examples, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def check(case: Case) -> None:
        COUNTS[run] += 1
        response = case.call(base_url=base_url, session=session, timeout=TIMEOUT_S, **extra)
        key = (run, case.method.upper(), response.status_code)
        STATUSES[key] = STATUSES.get(key, 0) + 1
        case.validate_response(response, checks=[not_a_server_error])

    with session:
        check()


def strategies(operation: APIOperation, *, negative: bool) -> st.SearchStrategy[Case]:
    fixed = {
        name: value
        for name, value in {"model": "tiny", "version": "1"}.items()
        if f"{{{name}}}" in operation.path
    }
    options = [operation.as_strategy(GenerationMode.POSITIVE)]
    if fixed:  # the served model too, not only random names
        options.append(operation.as_strategy(GenerationMode.POSITIVE, path_parameters=fixed))
    if negative:
        options.append(operation.as_strategy(GenerationMode.NEGATIVE))
    return st.one_of(options)


# ---- the real engine ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live_schemas(live_server: RunningServer) -> dict[str, schemathesis.BaseSchema]:
    return {
        name: schemathesis.openapi.from_dict(bounded(fetch_document(live_server, name)))
        for name in ("data", "management")
    }


def live_operations() -> list[tuple[str, str, str]]:
    """(listener, method, path) of the live run, from the route table (collection time)."""
    from tests.operations import OPERATIONS

    chosen = []
    for op in OPERATIONS:
        writes_management = op.listener == "management" and op.method != "GET"
        writes_adapters = "/adapters" in op.path and op.method != "GET"
        if op.listener == "metrics" or writes_management or writes_adapters:
            continue
        if not any(part in op.path for part in LIVE_EXCLUDED_PATHS):
            chosen.append((op.listener, op.method, op.path))
    return chosen


@pytest.mark.parametrize(("listener", "method", "path"), live_operations())
def test_live_engine_answers_no_5xx(
    live_server: RunningServer,
    live_schemas: dict[str, schemathesis.BaseSchema],
    listener: str,
    method: str,
    path: str,
) -> None:
    operation = live_schemas[listener][path][method]
    base = live_server.url if listener == "data" else live_server.management_url
    run_cases(
        strategies(operation, negative=False), base_url=base,
        examples=LIVE_CASES_PER_OPERATION, run="live",
    )


# ---- the fake engine, every operation, negative cases too -------------------------------------
@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("fuzz")
    with running_server(folder, engine="fake", ready_timeout=60) as server:
        yield server


def fake_operations() -> list[tuple[str, str, str]]:
    from tests.operations import OPERATIONS

    return [
        (op.listener, op.method, op.path)
        for op in OPERATIONS
        if not any(part in op.path for part in FAKE_EXCLUDED_PATHS)
    ]


@pytest.fixture(scope="module")
def fake_schemas(fuzzed: RunningServer) -> dict[str, schemathesis.BaseSchema]:
    return {
        name: schemathesis.openapi.from_dict(fetch_document(fuzzed, name))
        for name in ("data", "management", "metrics")
    }


@pytest.mark.parametrize(("listener", "method", "path"), fake_operations())
def test_every_operation_answers_no_5xx_to_valid_and_invalid_cases(
    fuzzed: RunningServer,
    fake_schemas: dict[str, schemathesis.BaseSchema],
    listener: str,
    method: str,
    path: str,
) -> None:
    operation = fake_schemas[listener][path][method]
    base = {
        "data": fuzzed.url, "management": fuzzed.management_url, "metrics": fuzzed.metrics_url,
    }[listener]
    run_cases(
        strategies(operation, negative=True), base_url=base,
        examples=FAKE_CASES_PER_OPERATION, run="fake",
    )


# ---- raw request lines (Triton's L0_http_fuzz does this with boofuzz) ---------------------------
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"]


def request_bytes() -> st.SearchStrategy[bytes]:
    from tests.operations import OPERATIONS

    paths = sorted({
        op.path.replace("{model}", "tiny").replace("{version}", "1")
        for op in OPERATIONS
        if not any(part in op.path for part in FAKE_EXCLUDED_PATHS)
    })
    junk = st.binary(max_size=64)
    method = st.sampled_from(METHODS).map(str.encode) | junk
    path = st.sampled_from(paths).map(str.encode) | st.tuples(
        st.sampled_from(paths).map(str.encode), junk).map(b"".join) | junk
    version = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9", b""]) | junk
    header = st.tuples(junk, junk).map(lambda kv: kv[0] + b": " + kv[1])
    headers = st.lists(header | st.sampled_from([
        b"Content-Length: 5", b"Content-Length: -1", b"Transfer-Encoding: chunked",
        b"Content-Length: 99999999999999999999", b"Expect: 100-continue",
        b"Content-Type: application/json",
    ]), max_size=5)
    body = junk | st.sampled_from([b"{}", b"0\r\n\r\n", b"5\r\nhello\r\n0\r\n\r\n", b"{"])
    return st.tuples(method, path, version, headers, body).map(
        lambda r: r[0] + b" " + r[1] + b" " + r[2] + b"\r\nHost: x\r\n"
        + b"".join(h + b"\r\n" for h in r[3]) + b"\r\n" + r[4]
    )


def exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)  # no more bytes: the server must answer or close
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer


def test_raw_request_line_fuzz_never_gets_a_5xx(fuzzed: RunningServer) -> None:
    statuses: dict[bytes, int] = {}

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=request_bytes())
    def check(data: bytes) -> None:
        answer = exchange(fuzzed.data_port, data)  # a TimeoutError here is a hang: fails
        status = answer[9:12] if answer.startswith(b"HTTP/1.") else b"closed"
        statuses[status] = statuses.get(status, 0) + 1
        assert not status.startswith(b"5"), (data, answer[:300])

    check()
    COUNTS["fake"] += sum(statuses.values())
    assert len(statuses) > 1, statuses  # both answers and refusals were seen


# ---- totals and aftermath -----------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def totals_after_every_fuzz_test(
    request: pytest.FixtureRequest, live_server: RunningServer, fuzzed: RunningServer
) -> Iterator[None]:
    """Once every test of this module ran (in whatever order), at least 2000 cases ran, none
    answered 5xx, and both servers still serve. Checked at the module's teardown, so no test
    depends on running after the others; skipped when only some of them were selected."""
    selected = [item for item in request.session.items if item.module is request.module]
    yield
    if len(FINISHED) != len(selected):
        return
    assert COUNTS["live"] + COUNTS["fake"] >= 2000, COUNTS
    assert COUNTS["live"] >= 1000, COUNTS
    print(f"schemathesis cases: {COUNTS}; statuses: {dict(sorted(STATUSES.items()))}")
    generated = STATUSES.get(("live", "POST", 200), 0)
    assert generated >= 150, STATUSES  # valid requests really ran on the real engine
    assert not [key for key in STATUSES if key[2] >= 500], STATUSES
    for server in (live_server, fuzzed):
        assert_still_serves(server, adapters={"a1", "a2", "a3"} if server is live_server else set())


@pytest.fixture(autouse=True)
def finished(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    FINISHED.add(request.node.nodeid)


def assert_still_serves(server: RunningServer, *, adapters: set[str]) -> None:
    body = {"prompt": "after the fuzz", "max_tokens": 2}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    with management_client(server, timeout=30) as http:
        gateway = http.get("/v1/status").json()["gateway"]
    assert gateway["state"] == "ready"
    assert gateway["inflight"] == 0
    assert set(gateway["adapters"]) >= adapters


def test_both_servers_serve_after_their_fuzzing(
    live_server: RunningServer, fuzzed: RunningServer
) -> None:
    """Whatever ran before this test (the module's totals are checked at its teardown)."""
    assert_still_serves(live_server, adapters={"a1", "a2", "a3"})
    assert_still_serves(fuzzed, adapters=set())
