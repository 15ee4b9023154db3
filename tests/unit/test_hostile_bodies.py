"""The broad search for 5xx answers (issue 19): hostile JSON (tests/unit/hostile.py) at every
documented field of every protocol's routes, through the in-process gateway on the fake engine.
Every answer is below 500, and a stream carries no in-band internal error. The real-server
sample: tests/integration/test_hostile_bodies.py."""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from protocols.kserve_v2.sampling import KNOBS
from server.core.json_limits import MAX_JSON_DEPTH, MAX_SCHEMA_DEPTH
from server.engines.fake import FakeEngine
from server.http import jsonio
from tests.unit.gateway_kit import client, make_gateway
from tests.unit.hostile import (
    CHAT,
    HOSTILE,
    ROUTES,
    TARGETS,
    cases,
    deep,
    deep_schema,
    schema_cases,
    spliced,
)
from tests.unit.test_kserve_grpc import Aborted, Context, raw_bytes, servicer

EXAMPLES = int(os.environ.get("HOSTILE_EXAMPLES", "500"))  # ~15 s; 1,500 pass too
JSON_HEADERS = {"content-type": "application/json"}
TIMEOUT_S = 20  # a hang fails the case
GRPC_EXAMPLES = 300


class Gateway:
    """One in-process gateway on its own event loop, driven from synchronous hypothesis tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        gateway = make_gateway(overrides={"LimitsConfig": {"maxConcurrentRequests": 64}})
        assert isinstance(gateway.engine, FakeEngine)
        self.engine = gateway.engine
        self.http = client(gateway, "data")
        self.triton = servicer(gateway)

    def post(self, path: str, body: bytes) -> httpx.Response:
        request = self.http.post(path, content=body, headers=JSON_HEADERS)
        return self.loop.run_until_complete(asyncio.wait_for(request, TIMEOUT_S))

    def close(self) -> None:
        self.loop.run_until_complete(self.http.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway()
    yield gw
    gw.close()


def assert_no_server_error(response: httpx.Response, path: str, body: bytes) -> None:
    shown = body[:300]
    assert response.status_code < 500, (path, shown, response.text[:300])
    assert "Internal error" not in response.text, (path, shown, response.text[:300])


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_hostile_values_never_answer_5xx(gateway: Gateway, case: tuple[str, bytes]) -> None:
    path, body = case
    assert_no_server_error(gateway.post(path, body), path, body)


def test_every_route_refuses_a_too_deep_body_naming_the_limit(gateway: Gateway) -> None:
    for path, base, fields in ROUTES:
        body = spliced(base, fields[0], deep(MAX_JSON_DEPTH))
        response = gateway.post(path, body)
        assert 400 <= response.status_code < 500, (path, response.text[:200])
        assert f"at most {MAX_JSON_DEPTH} levels" in response.text, (path, response.text[:200])


def test_a_body_at_the_depth_limit_is_not_refused_for_depth(gateway: Gateway) -> None:
    """`inputs` of TGI nested to exactly the limit: refused for its type, not its depth."""
    body = spliced({"parameters": {"max_new_tokens": 4}}, ("inputs",), deep(MAX_JSON_DEPTH - 1))
    response = gateway.post("/generate", body)
    assert response.status_code == 422
    assert "nested too deeply" not in response.text


@pytest.mark.parametrize(("path", "body", "levels"), schema_cases())
def test_schemas_deeper_than_the_engine_accepts_are_refused_in_every_protocol(
    gateway: Gateway, path: str, body: bytes, levels: int
) -> None:
    response = gateway.post(path, body)
    assert_no_server_error(response, path, body)
    refused = f"objects and arrays may nest at most {MAX_SCHEMA_DEPTH} levels" in response.text
    assert refused == (levels > MAX_SCHEMA_DEPTH), (path, levels, response.text[:300])
    if refused:
        assert 400 <= response.status_code < 500


def test_every_documented_field_is_attacked() -> None:
    assert len(TARGETS) > 300


@pytest.mark.parametrize(("levels", "refused"), [(MAX_SCHEMA_DEPTH - 1, False),
                                                  (MAX_SCHEMA_DEPTH + 1, True)])
def test_the_schema_limit_is_vllms_to_the_level(
    gateway: Gateway, levels: int, refused: bool
) -> None:
    schema = {"name": "x", "schema": deep_schema(levels)}
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": schema}}
    response = gateway.post("/v1/chat/completions", jsonio.dumps(body))
    assert (response.status_code == 400) == refused, response.text[:300]


# ---- Triton's gRPC service: hostile parameters, sampling JSON and prompt bytes ---------------
HOSTILE_TEXT = [raw for raw in HOSTILE if raw.isascii()]  # protobuf strings are UTF-8
GRPC_VALUES = st.one_of(
    st.builds(lambda v: service_pb2.InferParameter(double_param=v),
              st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 5e-324])),
    st.builds(lambda v: service_pb2.InferParameter(int64_param=v),
              st.sampled_from([-(2**63), 2**63 - 1, 0, -1])),
    st.builds(lambda v: service_pb2.InferParameter(uint64_param=v),
              st.sampled_from([2**64 - 1, 2**63])),
    st.builds(lambda i: service_pb2.InferParameter(string_param=HOSTILE_TEXT[i]),
              st.integers(0, len(HOSTILE_TEXT) - 1)),
    st.builds(lambda v: service_pb2.InferParameter(bool_param=v), st.booleans()),
)
PROMPTS = [b"hi", b"\xed\xa0\x80", b"\xff\xfe", b"", b"word " * 20_000]


@settings(max_examples=GRPC_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    knob=st.sampled_from(sorted(KNOBS)), value=GRPC_VALUES,
    sampling=st.integers(0, len(HOSTILE) - 1), prompt=st.sampled_from(PROMPTS),
)
def test_hostile_grpc_requests_get_a_client_status(
    gateway: Gateway, knob: str, value: Any, sampling: int, prompt: bytes
) -> None:
    request = service_pb2.ModelInferRequest(model_name="tiny")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    sampling_json = '{"max_tokens":3,"' + knob + '":' + HOSTILE[sampling] + "}"
    request.raw_input_contents.extend(
        [raw_bytes(prompt), raw_bytes(sampling_json.encode(errors="surrogatepass"))]
    )
    request.parameters[knob].CopyFrom(value)
    try:
        gateway.loop.run_until_complete(gateway.triton.ModelInfer(request, Context()))
    except Aborted as exc:
        assert exc.code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), exc.details
