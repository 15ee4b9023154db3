"""Triton's gRPC servicer and the gRPC interceptor in process, on the fake engine, with a
stand-in servicer context (no sockets): wire shapes, the final flag, the two error shapes of a
stream, status codes, cancellation, keys, metrics.

The real-engine proofs with tritonclient.grpc/.aio, TLS and a stop are in
tests/conformance/test_triton_grpc.py.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2

from protocols.kserve_v2 import errors
from protocols.kserve_v2.grpc_api import (
    TritonGrpc,
    decode_inputs,
    request_parameters,
)
from protocols.kserve_v2.stats import stats_of
from server.core.errors import (
    AdapterNotFound,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    ServiceUnavailable,
    Unsupported,
)
from server.engines.fake import FakeScript
from server.gateway import Gateway, protocol_context
from server.http.rpc import AccessInterceptor, GrpcService
from tests.unit.gateway_kit import make_gateway

pytestmark = pytest.mark.anyio


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Context:
    """What the servicer and the interceptor use of grpc.aio's ServicerContext."""

    def __init__(self, cert: bytes | None = None) -> None:
        self._code: grpc.StatusCode | None = None
        self._cert = cert
        self.trailers: tuple[tuple[str, str], ...] = ()

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailers = metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        raise Aborted(code, details)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_pem_cert": [self._cert]} if self._cert else {}


def servicer(gateway: Gateway) -> TritonGrpc:
    ctx = protocol_context(gateway.settings, gateway.service)
    return TritonGrpc(ctx, stats_of(ctx))


def raw_bytes(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


def infer_request(
    model: str = "tiny",
    prompt: str = "a b c",
    sampling: dict[str, Any] | None = None,
    *,
    stream: bool | None = None,
    request_id: str = "",
    exclude: bool | None = None,
) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    raws: list[bytes] = []

    def add(name: str, datatype: str, raw: bytes) -> None:
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        raws.append(raw)

    add("text_input", "BYTES", raw_bytes(prompt.encode()))
    add("sampling_parameters", "BYTES",
        raw_bytes(json.dumps(sampling or {"max_tokens": 3, "temperature": 0}).encode()))
    if stream is not None:
        add("stream", "BOOL", bytes([stream]))
    if exclude is not None:
        add("exclude_input_in_output", "BOOL", bytes([exclude]))
    request.raw_input_contents.extend(raws)
    return request


async def requests_of(*items: Any) -> AsyncIterator[Any]:
    for item in items:
        yield item


async def stream_replies(api: TritonGrpc, *requests: Any) -> list[Any]:
    return [r async for r in api.ModelStreamInfer(requests_of(*requests), Context())]


def text(response: Any) -> str:
    raw = response.raw_output_contents[0]
    (length,) = struct.unpack_from("<I", raw)
    return raw[4 : 4 + length].decode()


def final(response: Any) -> bool:
    return bool(response.parameters["triton_final_response"].bool_param)


# ---- tensors and parameters ------------------------------------------------------------------
def test_inputs_come_from_raw_contents_or_typed_contents() -> None:
    raw = infer_request(stream=True)
    by_name = {t.name: t for t in decode_inputs(raw)}
    assert by_name["text_input"].data == (b"a b c",) and by_name["stream"].data == (True,)
    typed = service_pb2.ModelInferRequest(model_name="tiny")
    item = typed.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    item.contents.bytes_contents.append(b"hello")
    flag = typed.inputs.add(name="stream", datatype="BOOL", shape=[1])
    flag.contents.bool_contents.append(False)
    decoded = {t.name: t.data for t in decode_inputs(typed)}
    assert decoded == {"text_input": (b"hello",), "stream": (False,)}


def test_raw_contents_must_cover_every_input() -> None:
    request = infer_request()
    request.inputs.add(name="stream", datatype="BOOL", shape=[1])
    with pytest.raises(InvalidRequest, match="expected 3 inputs in raw_input_contents but got 2"):
        decode_inputs(request)


def test_raw_contents_and_typed_contents_are_not_mixed() -> None:
    request = infer_request()
    request.inputs[0].contents.bytes_contents.append(b"also typed")
    with pytest.raises(InvalidRequest, match=(
        "contents field must not be specified when using raw_input_contents for input "
        "'text_input' for model 'tiny'"
    )):
        decode_inputs(request)


def test_request_parameters_are_plain_values() -> None:
    request = service_pb2.ModelInferRequest()
    request.parameters["max_tokens"].int64_param = 7
    request.parameters["temperature"].double_param = 0.5
    request.parameters["lora_name"].string_param = "a1"
    request.parameters["ignore_eos"].bool_param = True
    assert request_parameters(request.parameters) == {
        "max_tokens": 7, "temperature": 0.5, "lora_name": "a1", "ignore_eos": True,
    }


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequest("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (Unsupported("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (ModelNotFound("x"), grpc.StatusCode.NOT_FOUND),
        (AdapterNotFound("x"), grpc.StatusCode.NOT_FOUND),
        (Overloaded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ServiceUnavailable("x"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_domain_errors_map_to_trition_grpc_codes(error: Exception, code: grpc.StatusCode) -> None:
    assert errors.grpc_status(error) is code  # type: ignore[arg-type]


# ---- health and metadata -------------------------------------------------------------------
async def test_readiness_follows_the_lifecycle_and_unknown_models_are_not_ready() -> None:
    gateway = make_gateway(ready=False)
    api = servicer(gateway)
    assert (await api.ServerLive(service_pb2.ServerLiveRequest(), Context())).live
    assert not (await api.ServerReady(service_pb2.ServerReadyRequest(), Context())).ready
    gateway.lifecycle.ready()
    assert (await api.ServerReady(service_pb2.ServerReadyRequest(), Context())).ready
    ask = service_pb2.ModelReadyRequest
    assert (await api.ModelReady(ask(name="tiny"), Context())).ready
    assert not (await api.ModelReady(ask(name="nope"), Context())).ready


async def test_metadata_of_an_unknown_model_is_not_found() -> None:
    api = servicer(make_gateway())
    with pytest.raises(Aborted) as caught:
        await api.ModelMetadata(service_pb2.ModelMetadataRequest(name="nope"), Context())
    assert caught.value.code is grpc.StatusCode.NOT_FOUND
    assert caught.value.details == "Request for unknown model: 'nope' is not found"


async def test_config_statistics_and_index() -> None:
    api = servicer(make_gateway())
    config = await api.ModelConfig(service_pb2.ModelConfigRequest(name="tiny"), Context())
    assert config.config.backend == "vllm" and config.config.model_transaction_policy.decoupled
    await api.ModelInfer(infer_request(), Context())
    stats = await api.ModelStatistics(service_pb2.ModelStatisticsRequest(name="tiny"), Context())
    assert stats.model_stats[0].inference_count == 1
    index = await api.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True), Context())
    assert [m.name for m in index.models] == ["tiny"]


# ---- inference ---------------------------------------------------------------------------------
async def test_streamed_deltas_carry_the_final_flag_on_the_last() -> None:
    api = servicer(make_gateway())
    replies = await stream_replies(api, infer_request(stream=True, request_id="s-1"))
    assert all(not r.error_message for r in replies)
    responses = [r.infer_response for r in replies]
    assert [final(r) for r in responses] == [False] * (len(responses) - 1) + [True]
    assert "".join(text(r) for r in responses) == "a b c "
    assert {(r.id, r.model_name, r.model_version) for r in responses} == {("s-1", "tiny", "1")}


async def test_one_final_response_per_request_even_when_an_empty_final_is_enabled() -> None:
    """perf_analyzer sets triton_enable_empty_final_response; the vLLM backend's final flag rides
    on its last real response, so no empty final follows (a second final would make a client
    that paces on finals send twice)."""
    api = servicer(make_gateway())
    request = infer_request(stream=True, request_id="p-1")
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    replies = await stream_replies(api, request)
    assert [final(r.infer_response) for r in replies].count(True) == 1
    assert all(r.infer_response.raw_output_contents for r in replies)


async def test_without_stream_one_whole_final_response_with_the_prompt() -> None:
    api = servicer(make_gateway())
    (reply,) = await stream_replies(api, infer_request())
    assert final(reply.infer_response) and text(reply.infer_response) == "a b ca b c "
    (excluded,) = await stream_replies(api, infer_request(exclude=True))
    assert text(excluded.infer_response) == "a b c "


async def test_a_refused_request_in_a_stream_carries_only_its_id_and_the_rest_runs() -> None:
    api = servicer(make_gateway())
    replies = await stream_replies(
        api, infer_request("nope", request_id="bad"), infer_request(request_id="good")
    )
    refused = next(r for r in replies if r.error_message)
    assert refused.error_message == "Request for unknown model: 'nope' is not found"
    assert refused.infer_response.id == "bad" and not refused.infer_response.model_name
    assert "triton_final_response" not in refused.infer_response.parameters
    assert any(r.infer_response.id == "good" and final(r.infer_response) for r in replies)


async def test_a_request_failing_while_generating_is_a_final_error_response() -> None:
    api = servicer(make_gateway(FakeScript(fail_after=1)))
    replies = await stream_replies(api, infer_request(stream=True, request_id="f-1"))
    failed = replies[-1]
    assert failed.error_message == "scripted failure"
    assert failed.infer_response.id == "f-1" and failed.infer_response.model_name == "tiny"
    assert final(failed.infer_response)


async def test_unary_infer_errors_are_status_codes() -> None:
    api = servicer(make_gateway())
    with pytest.raises(Aborted) as caught:
        await api.ModelInfer(infer_request(sampling={"max_tokens": 0}), Context())
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(Aborted) as caught:
        await api.ModelInfer(infer_request(sampling={"lora_name": "zz"}), Context())
    assert caught.value.code is grpc.StatusCode.NOT_FOUND


async def test_a_full_server_is_resource_exhausted() -> None:
    gateway = make_gateway(
        FakeScript(hang_after=1),
        overrides={"LimitsConfig": {"maxConcurrentRequests": 1, "maxQueue": 0}},
    )
    api = servicer(gateway)
    hanging = api.ModelStreamInfer(requests_of(infer_request(stream=True)), Context())
    first = await anext(hanging)
    assert not first.error_message
    with pytest.raises(Aborted) as caught:
        await api.ModelInfer(infer_request(), Context())
    assert caught.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    await hanging.aclose()


async def test_closing_the_stream_aborts_its_engine_requests() -> None:
    gateway = make_gateway(FakeScript(hang_after=1))
    api = servicer(gateway)
    stream = api.ModelStreamInfer(requests_of(infer_request(stream=True)), Context())
    await anext(stream)
    assert gateway.lifecycle.inflight == 1
    await stream.aclose()  # what grpc.aio does when the client cancels the call
    for _ in range(50):
        if gateway.lifecycle.inflight == 0:
            break
        await asyncio.sleep(0.01)
    assert gateway.lifecycle.inflight == 0


async def test_a_draining_server_refuses_with_tritons_words() -> None:
    gateway = make_gateway()
    gateway.lifecycle.begin_drain()
    api = servicer(gateway)
    (reply,) = await stream_replies(api, infer_request(request_id="late"))
    assert reply.error_message == (
        "GRPC server is shutting down and has stopped accepting new requests."
    )
    with pytest.raises(Aborted) as caught:
        await api.ModelInfer(infer_request(), Context())
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE


# ---- the interceptor ---------------------------------------------------------------------------
class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def rpc(self, owner: str, method: str, code: str, seconds: float) -> None:
        self.calls.append((owner, method, code))


class Details:
    def __init__(self, method: str, metadata: Iterable[tuple[str, str]] = ()) -> None:
        self.method = method
        self.invocation_metadata = tuple(metadata)


SERVICE = GrpcService(
    name="demo.Echo", owner="demo", add_to=lambda server: None,
    open_methods=frozenset({"/demo.Echo/Live"}),
)


async def echo(request: Any, context: Any) -> Any:
    return request


async def intercepted(
    interceptor: AccessInterceptor, method: str, metadata: Iterable[tuple[str, str]] = (),
    context: Context | None = None,
) -> Any:
    async def continuation(details: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(echo)

    handler = await interceptor.intercept_service(continuation, Details(method, metadata))
    return await handler.unary_unary("ping", context or Context())


async def test_keys_are_bearer_tokens_in_the_authorization_metadata() -> None:
    from server.http.auth import Keyring

    recorder = Recorder()
    interceptor = AccessInterceptor(Keyring(["k1"]), (SERVICE,), recorder)
    assert await intercepted(interceptor, "/demo.Echo/Live") == "ping"  # open
    with pytest.raises(Aborted) as caught:
        await intercepted(interceptor, "/demo.Echo/Work")
    assert caught.value.code is grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(Aborted):
        await intercepted(interceptor, "/demo.Echo/Work", [("authorization", "Bearer k2")])
    ok = await intercepted(interceptor, "/demo.Echo/Work", [("authorization", "Bearer k1")])
    assert ok == "ping"
    assert recorder.calls == [
        ("demo", "Live", "OK"), ("demo", "Work", "UNAUTHENTICATED"),
        ("demo", "Work", "UNAUTHENTICATED"), ("demo", "Work", "OK"),
    ]


async def test_a_revoked_client_certificate_is_refused() -> None:
    from server.http.auth import Keyring

    interceptor = AccessInterceptor(
        Keyring(), (SERVICE,), Recorder(), peer_allowed=lambda pem: pem == b"good"
    )
    assert await intercepted(interceptor, "/demo.Echo/Work", context=Context(b"good")) == "ping"
    with pytest.raises(Aborted) as caught:
        await intercepted(interceptor, "/demo.Echo/Work", context=Context(b"revoked"))
    assert caught.value.details == "The client certificate has been revoked."


async def test_grpc_calls_are_counted_in_the_gateways_metrics() -> None:
    gateway = make_gateway()
    gateway.metrics.rpc("kserve", "ModelStreamInfer", "OK", 0.01)
    counted = gateway.metrics.grpc_requests.labels("kserve", "ModelStreamInfer", "OK").value
    assert counted == 1


async def test_a_unary_call_says_the_gateways_overhead_in_its_trailers() -> None:
    """The handler waits 50 ms on the engine; the trailer leaves that out (server/core/overhead)."""
    from server.core.overhead import on_engine
    from server.http.auth import Keyring

    async def engine_bound(request: Any, context: Any) -> Any:
        await on_engine(asyncio.sleep(0.05))
        return request

    async def continuation(details: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(engine_bound)

    interceptor = AccessInterceptor(Keyring(), (SERVICE,), Recorder())
    handler = await interceptor.intercept_service(continuation, Details("/demo.Echo/Work"))
    context = Context()
    assert await handler.unary_unary("ping", context) == "ping"
    (name, value), = context.trailers
    assert name == "x-gateway-overhead-ms"
    assert 0.0 <= float(value) < 25.0
