"""Hostile input on the real engine (issue 19): the focused sample of the unit tier's broad search
(tests/unit/test_hostile_bodies.py), against the shared real server. Deep nesting, huge numbers,
NaN/Infinity, lone surrogates, very long strings and wrong types at documented fields of every
protocol's routes, JSON schemas around the depth limit in every way a schema reaches the engine,
the same through Triton's gRPC service, and `best_of`: never a 5xx, the engine alive after.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from tritonclient.grpc import service_pb2, service_pb2_grpc

from server.core.json_limits import MAX_JSON_DEPTH, MAX_SCHEMA_DEPTH
from tests.serverproc import RunningServer
from tests.unit.hostile import ROUTES, cases, deep, deep_schema, schema_cases, spliced

pytestmark = [pytest.mark.server, pytest.mark.engine]

LIVE_EXAMPLES = 400  # about 1 s on the demo model; the unit tier draws 500 on the fake engine
JSON_HEADERS = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def http(live_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=120, headers=JSON_HEADERS) as c:
        yield c


def assert_no_server_error(response: httpx.Response, path: str, body: bytes) -> None:
    assert response.status_code < 500, (path, body[:300], response.text[:300])
    assert "Internal error" not in response.text, (path, body[:300], response.text[:300])


def assert_engine_alive(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    answer = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 200, answer.text


@settings(max_examples=LIVE_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_hostile_values_never_answer_5xx_on_the_real_engine(
    http: httpx.Client, case: tuple[str, bytes]
) -> None:
    path, body = case
    assert_no_server_error(http.post(path, content=body), path, body)


def test_every_route_refuses_a_too_deep_body_naming_the_limit(http: httpx.Client) -> None:
    """The issue's case first: a response_format schema nested 200 levels was a 500."""
    schema = {"name": "x", "schema": deep_schema(201)}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": schema}}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert f"at most {MAX_JSON_DEPTH} levels" in response.json()["error"]["message"]
    for path, base, fields in ROUTES:
        raw = spliced(base, fields[0], deep(MAX_JSON_DEPTH))
        response = http.post(path, content=raw)
        assert 400 <= response.status_code < 500, (path, response.text[:200])
        assert f"at most {MAX_JSON_DEPTH} levels" in response.text, (path, response.text[:200])
    assert_engine_alive(http)


def test_schemas_deeper_than_the_engine_accepts_are_refused_in_every_protocol(
    http: httpx.Client,
) -> None:
    for path, body, levels in schema_cases():
        response = http.post(path, content=body)
        assert_no_server_error(response, path, body)
        refused = f"objects and arrays may nest at most {MAX_SCHEMA_DEPTH} levels" in response.text
        assert refused == (levels > MAX_SCHEMA_DEPTH), (path, levels, response.text[:300])
    assert_engine_alive(http)


def _infer(parameters: dict[str, service_pb2.InferParameter],
           texts: tuple[bytes, ...] = (b"hi",)) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=[len(texts)])
    request.raw_input_contents.append(b"".join(len(t).to_bytes(4, "little") + t for t in texts))
    del tensor
    for key, value in {"max_tokens": service_pb2.InferParameter(int64_param=4),
                       **parameters}.items():
        request.parameters[key].CopyFrom(value)
    return request


GRPC_CASES: list[tuple[str, dict[str, service_pb2.InferParameter], tuple[bytes, ...]]] = [
    ("NaN temperature", {"temperature": service_pb2.InferParameter(double_param=math.nan)}, ()),
    ("infinite top_p", {"top_p": service_pb2.InferParameter(double_param=math.inf)}, ()),
    ("NaN penalty",
     {"repetition_penalty": service_pb2.InferParameter(double_param=math.nan)}, ()),
    ("huge max_tokens", {"max_tokens": service_pb2.InferParameter(uint64_param=2**64 - 1)}, ()),
    ("huge seed", {"seed": service_pb2.InferParameter(uint64_param=2**64 - 1)}, ()),
    ("negative n", {"n": service_pb2.InferParameter(int64_param=-(2**63))}, ()),
    ("best_of beyond the limit", {"best_of": service_pb2.InferParameter(int64_param=10**6)}, ()),
    ("deep structured_outputs", {"structured_outputs": service_pb2.InferParameter(
        string_param='{"json":' + deep(MAX_JSON_DEPTH + 10) + "}")}, ()),
    ("deep schema", {"structured_outputs": service_pb2.InferParameter(
        string_param=json.dumps({"json": deep_schema(MAX_SCHEMA_DEPTH + 1)}))}, ()),
    ("NaN in a JSON parameter",
     {"structured_outputs": service_pb2.InferParameter(string_param='{"json": NaN}')}, ()),
    ("lone surrogate in the prompt bytes", {}, (b"\xed\xa0\x80",)),
    ("invalid UTF-8 prompt", {}, (b"\xff\xfe",)),
    ("a long prompt", {}, (b"word " * 20_000,)),
]


@pytest.mark.parametrize(("case", "parameters", "texts"), GRPC_CASES,
                         ids=[c[0] for c in GRPC_CASES])
def test_hostile_grpc_requests_are_refused_with_a_client_status(
    live_server: RunningServer, http: httpx.Client, case: str,
    parameters: dict[str, service_pb2.InferParameter], texts: tuple[bytes, ...],
) -> None:
    with grpc.insecure_channel(live_server.grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ModelInfer(_infer(parameters, texts or (b"hi",)), timeout=120)
        except grpc.RpcError as exc:
            assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                      grpc.StatusCode.UNAVAILABLE), (case, exc.details())
    assert_engine_alive(http)


@pytest.mark.parametrize(("fields", "status"), [
    ({"best_of": 1_000_000}, 400), ({"best_of": 3, "n": 2}, 400), ({"best_of": 1, "n": 2}, 400),
    ({"best_of": 2, "n": 2}, 200),
])
def test_best_of_is_applied_or_refused_never_dropped(
    http: httpx.Client, fields: dict[str, int], status: int
) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    if status == 400:
        assert response.json()["error"]["param"] == "best_of"
    else:
        assert len(response.json()["choices"]) == fields["n"]


def test_knobs_the_engine_cannot_honour_are_refused_in_each_protocol(http: httpx.Client) -> None:
    refused = [
        ("/infer", {"inputs": "hi", "parameters": {"typical_p": 0.5}}, None, "typical_p"),
        ("/invocations", {"inputs": "hi", "parameters": {"num_beams": 2}}, 424, "num_beams"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "watermarking": True}, 400,
         "watermarking"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                  "cache_salt": "tenant-a"}, 400, "cache_salt"),
    ]
    for path, body, status, name in refused:
        response = http.post(path, json=body)
        assert 400 <= response.status_code < 500, (path, response.text)
        assert status is None or response.status_code == status, (path, response.text)
        assert name in response.text and "not supported" in response.text, (path, response.text)
    assert_engine_alive(http)


def test_include_stop_str_in_output_is_applied_on_djl(http: httpx.Client) -> None:
    """Dropped before: LMI's `include_stop_str_in_output` now reaches the engine."""
    parameters = {"max_new_tokens": 12, "ignore_eos": True}
    plain = http.post("/invocations", json={"inputs": "The quick brown fox",
                                            "parameters": parameters})
    assert plain.status_code == 200, plain.text
    text = plain.json()["generated_text"]
    words = text.split()
    stop = max(words[len(words) // 2:], key=len)  # a long word: no earlier accidental match
    for include in (False, True):
        body = {"inputs": "The quick brown fox",
                "parameters": {**parameters, "stop": [stop], "include_stop_str_in_output": include}}
        answer = http.post("/invocations", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["generated_text"].endswith(stop) == include, (stop, answer.text)
