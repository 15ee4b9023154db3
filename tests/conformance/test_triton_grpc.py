"""Triton's gRPC protocol against the real server process on the real vLLM engine, with the
official `tritonclient.grpc` and `tritonclient.grpc.aio`, and `grpc.health.v1` as a Kubernetes
gRPC probe sends it.

The shared server listens for plaintext gRPC; a second server (mutual TLS with the README's
certificates, bearer keys) proves the secured listener and, last, a stop under load.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conformance.test_triton_clients import wait_idle
from tests.integration.traffic import management_client
from tests.serverproc import CERTS, RunningServer, running_server

pytestmark = [pytest.mark.server, pytest.mark.engine]

PROMPT = "The quick brown fox"
Reply = tuple[Any, InferenceServerException | None]


@pytest.fixture(scope="module")
def client(live_server: RunningServer) -> Iterator[tg.InferenceServerClient]:
    c = tg.InferenceServerClient(live_server.grpc_address)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(live_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=120) as c:
        yield c


def greedy(max_tokens: int = 8, **more: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **more}


def inputs(
    prompt: str = PROMPT,
    sampling: dict[str, Any] | None = None,
    *,
    stream: bool | None = None,
    exclude: bool | None = None,
) -> list[tg.InferInput]:
    text = tg.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    found = [text]
    if sampling is not None:
        params = tg.InferInput("sampling_parameters", [1], "BYTES")
        params.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
        found.append(params)
    for name, flag in (("stream", stream), ("exclude_input_in_output", exclude)):
        if flag is not None:
            tensor = tg.InferInput(name, [1], "BOOL")
            tensor.set_data_from_numpy(np.array([flag], dtype=bool))
            found.append(tensor)
    return found


class Stream:
    """A tritonclient stream whose callback feeds a queue."""

    def __init__(self, client: tg.InferenceServerClient, **start: Any) -> None:
        self.client = client
        self.replies: queue.Queue[Reply] = queue.Queue()
        client.start_stream(callback=lambda result, error: self.replies.put((result, error)),
                            **start)

    def until_final(self, timeout: float = 120.0) -> list[Reply]:
        got: list[Reply] = []
        while True:
            result, error = self.replies.get(timeout=timeout)
            got.append((result, error))
            if error is not None or is_final(result):
                return got


def is_final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def text_of(result: Any) -> str:
    return "".join(item.decode() for item in result.as_numpy("text_output"))


def http_generate(http: httpx.Client, model: str, sampling: dict[str, Any]) -> str:
    r = http.post(f"/v2/models/{model}/generate", json={
        "text_input": PROMPT, "exclude_input_in_output": True, "parameters": sampling,
    })
    assert r.status_code == 200, r.text
    text: str = r.json()["text_output"]
    return text


# ---- health, metadata, config, statistics, index ------------------------------------------
def test_health_and_readiness(client: tg.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("a1", "1")
    assert not client.is_model_ready("nope")  # released Triton: not ready, no error


def test_metadata_and_config_are_the_vllm_backends(client: tg.InferenceServerClient) -> None:
    meta = client.get_model_metadata("tiny", as_json=True)
    assert meta["platform"] == "vllm" and meta["versions"] == ["1"]
    assert [i["name"] for i in meta["inputs"]][:2] == ["text_input", "stream"]
    assert meta["outputs"][0] == {"name": "text_output", "datatype": "BYTES", "shape": ["-1"]}
    config = client.get_model_config("a1", as_json=True)["config"]
    assert config["backend"] == "vllm" and config["model_transaction_policy"]["decoupled"]
    assert config["parameters"]["base_model"]["string_value"] == "tiny"
    server = client.get_server_metadata(as_json=True)
    assert "generate" in server["extensions"]


def test_repository_index_lists_the_base_model_and_every_adapter(
    client: tg.InferenceServerClient,
) -> None:
    index = client.get_model_repository_index(as_json=True)["models"]
    names = {m["name"] for m in index}
    assert {"tiny", "a1", "a2"} <= names
    assert all(m["state"] == "READY" and m["version"] == "1" for m in index)


def test_statistics_count_grpc_and_http_inferences_alike(
    client: tg.InferenceServerClient, http: httpx.Client
) -> None:
    def successes() -> int:
        stats = client.get_inference_statistics("a2", as_json=True)["model_stats"][0]
        return int(stats["inference_stats"].get("success", {}).get("count", 0))

    before = successes()
    http_generate(http, "a2", greedy(2))
    client.infer("a2", inputs(sampling=greedy(2)))
    assert successes() == before + 2


def test_an_unknown_model_is_not_found(client: tg.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("nope")
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    assert "Request for unknown model: 'nope' is not found" in caught.value.message()


# ---- stream_infer -------------------------------------------------------------------------
def test_streamed_deltas_end_with_the_final_flag_and_match_http_generate(
    client: tg.InferenceServerClient, http: httpx.Client
) -> None:
    expected = http_generate(http, "tiny", greedy(12))
    stream = Stream(client)
    try:
        client.async_stream_infer("tiny", inputs(sampling=greedy(12), stream=True),
                                  request_id="g-1")
        replies = stream.until_final()
    finally:
        client.stop_stream()
    assert all(error is None for _, error in replies)
    results = [result for result, _ in replies]
    assert len(results) > 1
    assert [is_final(r) for r in results] == [False] * (len(results) - 1) + [True]
    assert all(r.get_response().id == "g-1" for r in results)
    assert all(r.get_response().model_name == "tiny" for r in results)
    assert "".join(text_of(r) for r in results) == expected


def test_without_stream_one_final_response_with_the_prompt_first(
    client: tg.InferenceServerClient, http: httpx.Client
) -> None:
    expected = http_generate(http, "tiny", greedy(6))
    stream = Stream(client)
    try:
        client.async_stream_infer("tiny", inputs(sampling=greedy(6)))
        replies = stream.until_final()
    finally:
        client.stop_stream()
    assert len(replies) == 1 and replies[0][1] is None
    assert text_of(replies[0][0]) == PROMPT + expected


def test_an_adapter_by_model_name_and_by_lora_name(
    client: tg.InferenceServerClient, http: httpx.Client
) -> None:
    expected = http_generate(http, "a1", greedy(8))
    assert expected != http_generate(http, "tiny", greedy(8))
    stream = Stream(client)
    try:
        client.async_stream_infer("a1", inputs(sampling=greedy(8), exclude=True))
        by_model = stream.until_final()
        client.async_stream_infer(
            "tiny", inputs(sampling=greedy(8, lora_name="a1"), exclude=True)
        )
        by_lora = stream.until_final()
    finally:
        client.stop_stream()
    assert text_of(by_model[0][0]) == expected == text_of(by_lora[0][0])
    assert by_model[0][0].get_response().model_name == "a1"


def test_requests_on_one_stream_interleave_and_each_finishes(
    client: tg.InferenceServerClient,
) -> None:
    stream = Stream(client)
    try:
        for n in range(3):
            client.async_stream_infer("tiny", inputs(sampling=greedy(6), stream=True),
                                      request_id=f"m-{n}")
        finals: set[str] = set()
        while len(finals) < 3:
            result, error = stream.replies.get(timeout=120)
            assert error is None
            if is_final(result):
                finals.add(result.get_response().id)
    finally:
        client.stop_stream()
    assert finals == {"m-0", "m-1", "m-2"}


def test_unary_infer_answers_like_the_http_infer_route(
    client: tg.InferenceServerClient, http: httpx.Client
) -> None:
    expected = http_generate(http, "tiny", greedy(5))
    result = client.infer("tiny", inputs(sampling=greedy(5), exclude=True),
                          outputs=[tg.InferRequestedOutput("text_output")])
    assert text_of(result) == expected


@pytest.mark.anyio
async def test_the_aio_client_streams_too(live_server: RunningServer, http: httpx.Client) -> None:
    expected = http_generate(http, "tiny", greedy(8))
    client = tga.InferenceServerClient(live_server.grpc_address)

    async def requests() -> Any:
        yield {"model_name": "tiny", "inputs": inputs(sampling=greedy(8), stream=True),
               "request_id": "aio-1"}

    texts: list[str] = []
    try:
        assert await client.is_server_ready()
        async for result, error in client.stream_infer(requests()):
            assert error is None
            texts.append(text_of(result))
            if is_final(result):
                break
    finally:
        await client.close()
    assert "".join(texts) == expected


# ---- errors -------------------------------------------------------------------------------
def stream_error(client: tg.InferenceServerClient, model: str, found: list[Any]) -> str:
    stream = Stream(client)
    try:
        client.async_stream_infer(model, found, request_id="bad-1")
        replies = stream.until_final()
    finally:
        client.stop_stream()
    error = replies[-1][1]
    assert error is not None, replies
    return error.message()


def bytes_input(name: str, value: bytes) -> tg.InferInput:
    tensor = tg.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value], dtype=np.object_))
    return tensor


@pytest.mark.parametrize(
    ("model", "found", "message"),
    [
        ("nope", inputs(sampling=greedy(2)), "Request for unknown model: 'nope' is not found"),
        ("tiny", [bytes_input("sampling_parameters", b"{}")], "missing required input(s) "
         "['text_input']"),
        ("tiny", [bytes_input("text_input", b"x"), bytes_input("sampling_parameters", b"{nope")],
         "input 'sampling_parameters' must hold a JSON object"),
        ("tiny", [bytes_input("text_input", b"x"), bytes_input("stream", b"yes")],
         "data-type is 'BYTES', but model 'tiny' expects 'BOOL'"),
        ("tiny", inputs(sampling={"max_tokens": 2, "frob": 1}),
         "Unexpected keyword argument 'frob'"),
        ("tiny", inputs(sampling=greedy(2, lora_name="zz")), "LoRA zz is not supported"),
        ("tiny", inputs(sampling=greedy(2), stream=True, exclude=False),
         "`exclude_input_in_output` = False is not allowed"),
    ],
    ids=["unknown-model", "no-text-input", "bad-json", "wrong-dtype", "unknown-knob",
         "unknown-adapter", "stream-with-prompt"],
)
def test_bad_input_in_a_stream_is_an_error_message_and_the_engine_serves_on(
    client: tg.InferenceServerClient, http: httpx.Client, model: str, found: list[Any],
    message: str,
) -> None:
    assert message in stream_error(client, model, found)
    assert http_generate(http, "tiny", greedy(2))


@pytest.mark.parametrize(
    ("found", "code"),
    [
        ([bytes_input("sampling_parameters", b"{}")], "StatusCode.INVALID_ARGUMENT"),
        (inputs(sampling={"max_tokens": 0}), "StatusCode.INVALID_ARGUMENT"),
    ],
)
def test_bad_unary_infer_is_invalid_argument(
    client: tg.InferenceServerClient, found: list[Any], code: str
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client.infer("tiny", found)
    assert caught.value.status() == code


def test_a_message_over_max_request_length_is_resource_exhausted(
    client: tg.InferenceServerClient, http: httpx.Client
) -> None:
    """The shared server's maxRequestLength is 1 MB."""
    with pytest.raises(InferenceServerException) as caught:
        client.infer("tiny", inputs("word " * 300_000, greedy(2)))
    assert caught.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert http_generate(http, "tiny", greedy(2))


def test_raw_stub_request_errors_keep_the_request_id(live_server: RunningServer) -> None:
    """A refused request's error response carries its id (tritonclient hides it)."""
    with grpc.insecure_channel(live_server.grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="nope", id="raw-7")
        replies = list(stub.ModelStreamInfer(iter([request])))
    assert len(replies) == 1
    assert replies[0].infer_response.id == "raw-7"
    assert "unknown model" in replies[0].error_message


# ---- cancellation -------------------------------------------------------------------------
def test_cancelling_the_stream_aborts_the_engine_request(
    client: tg.InferenceServerClient, http: httpx.Client
) -> None:
    stream = Stream(client)
    client.async_stream_infer("tiny", inputs(sampling=greedy(400), stream=True))
    first, error = stream.replies.get(timeout=120)
    assert error is None and not is_final(first)
    assert wait_idle(http, 0.0)["free_slots"] < wait_idle(http, 0.0)["total_slots"]
    client.stop_stream(cancel_requests=True)
    idle = wait_idle(http)
    assert idle["free_slots"] == idle["total_slots"], "the engine request must be aborted"


# ---- grpc.health.v1 -----------------------------------------------------------------------
def test_a_kubernetes_grpc_probe_sees_serving(live_server: RunningServer) -> None:
    with grpc.insecure_channel(live_server.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


# ---- mutual TLS, bearer keys, stop ----------------------------------------------------------
KEY = "grpc-key-1"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    overrides = {
        "ServerConfig": {"grpcHttpsEnabled": True},
        "SecurityConfig": {"apiKeys": [KEY]},
        "LimitsConfig": {"drainTimeout": 20},
    }
    with running_server(tmp_path_factory.mktemp("grpc-tls"), overrides=overrides) as server:
        yield server


def tls_client(server: RunningServer, name: str = "client") -> tg.InferenceServerClient:
    return tg.InferenceServerClient(
        server.grpc_address, ssl=True, root_certificates=str(CERTS / "ca.pem"),
        private_key=str(CERTS / f"{name}.key"), certificate_chain=str(CERTS / f"{name}.pem"),
    )


AUTH = {"authorization": f"Bearer {KEY}"}


def test_mutual_tls_with_the_readme_certificates_and_a_key(secured: RunningServer) -> None:
    client = tls_client(secured)
    try:
        assert client.is_server_ready()  # health needs no key
        with pytest.raises(InferenceServerException) as caught:
            client.get_model_metadata("tiny")
        assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
        result = client.infer("tiny", inputs(sampling=greedy(4), exclude=True), headers=AUTH)
        assert text_of(result)
    finally:
        client.close()


@pytest.mark.parametrize("name", ["revoked-client", "rogue-client"])
def test_a_revoked_or_foreign_client_certificate_is_refused(
    secured: RunningServer, name: str
) -> None:
    client = tls_client(secured, name)
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.infer("tiny", inputs(sampling=greedy(2)), headers=AUTH)
    finally:
        client.close()
    assert caught.value.status() in ("StatusCode.UNAUTHENTICATED", "StatusCode.UNAVAILABLE")


def test_no_client_certificate_is_refused(secured: RunningServer) -> None:
    client = tg.InferenceServerClient(
        secured.grpc_address, ssl=True, root_certificates=str(CERTS / "ca.pem")
    )
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.is_server_live()
    finally:
        client.close()
    assert caught.value.status() == "StatusCode.UNAVAILABLE"


def test_a_stop_drains_streams_then_refuses_and_probes_say_not_serving(
    secured: RunningServer,
) -> None:
    """Last in this module: it stops the secured server."""
    client = tls_client(secured)
    stream = Stream(client, headers=AUTH)
    client.async_stream_infer("tiny", inputs(sampling=greedy(400), stream=True))
    assert stream.replies.get(timeout=120)[1] is None
    management = management_client(secured, timeout=60)
    stopper = threading.Thread(target=lambda: management.get("/stopService", headers=AUTH))
    stopper.start()
    time.sleep(0.5)
    assert not client.is_server_ready()
    probe = health_pb2_grpc.HealthStub(_tls_channel(secured))
    reply = probe.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    late = Stream(tls_client(secured), headers=AUTH)
    late.client.async_stream_infer("tiny", inputs(sampling=greedy(2), stream=True))
    _, refused = late.replies.get(timeout=30)
    assert refused is not None and "shutting down" in refused.message().lower()
    replies = stream.until_final()
    assert replies[-1][1] is None and is_final(replies[-1][0]), "the running stream completes"
    stopper.join(60)
    assert secured.process.wait(60) == 0


def _tls_channel(server: RunningServer) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(CERTS / "ca.pem").read_bytes(),
        private_key=(CERTS / "client.key").read_bytes(),
        certificate_chain=(CERTS / "client.pem").read_bytes(),
    )
    return grpc.secure_channel(server.grpc_address, credentials)

