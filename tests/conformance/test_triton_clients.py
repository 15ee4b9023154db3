"""Triton / KServe v2 against the real server process on the real vLLM engine.

The official `tritonclient.http` (synchronous, geventhttpclient) drives health, metadata, config,
statistics and `infer` in both tensor encodings; raw httpx drives the generate extension, the
SSE framing, MindIE's token infer, `stopInfer`, `getSlotCount`, client disconnects and bad input.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.serverproc import RunningServer

pytestmark = [pytest.mark.server, pytest.mark.engine]

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(live_server: RunningServer) -> RunningServer:
    return live_server


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(url=f"127.0.0.1:{server.data_port}", network_timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def text_inputs(
    prompt: str, sampling: dict[str, Any], *, binary: bool = True, exclude: bool = True
) -> list[triton.InferInput]:
    text = triton.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_), binary_data=binary)
    params = triton.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(
        np.array([json.dumps(sampling).encode()], dtype=np.object_), binary_data=binary
    )
    flag = triton.InferInput("exclude_input_in_output", [1], "BOOL")
    flag.set_data_from_numpy(np.array([exclude], dtype=bool), binary_data=binary)
    return [text, params, flag]


def greedy(max_tokens: int = 8) -> dict[str, Any]:
    return {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}


def sse_events(text: str) -> list[dict[str, Any]]:
    frames = text.split("\n\n")
    assert frames[-1] == "", "the stream must end with a complete event"
    assert all(f.startswith("data: ") for f in frames[:-1]), frames
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def slots(http: httpx.Client) -> dict[str, int]:
    r = http.get("/v2/models/tiny/getSlotCount")
    assert r.status_code == 200
    body: dict[str, int] = r.json()
    return body


def wait_idle(http: httpx.Client, deadline_s: float = 30.0) -> dict[str, int]:
    """Poll getSlotCount until every slot is free again (nothing in flight)."""
    end = time.monotonic() + deadline_s
    while True:
        current = slots(http)
        if current["free_slots"] == current["total_slots"] or time.monotonic() > end:
            return current
        time.sleep(0.05)


def success_and_fail(client: triton.InferenceServerClient, model: str) -> tuple[int, int]:
    stats = client.get_inference_statistics(model_name=model)["model_stats"][0]
    return stats["inference_stats"]["success"]["count"], stats["inference_stats"]["fail"]["count"]


# ---- health, metadata, config, statistics with tritonclient --------------------------------------
def test_server_and_models_are_live_and_ready(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("tiny")
    assert client.is_model_ready("tiny", model_version="1")
    assert client.is_model_ready("a1")
    assert not client.is_model_ready("nope")


def test_health_bodies_are_the_open_inference_protocols(live_server: RunningServer) -> None:
    """What KServe's InferenceRESTClient reads: `live` and `ready` from the body of a 2xx answer,
    a model's readiness from the status (kserve/kserve python/kserve/kserve/inference_client.py;
    the `kserve` package itself would pin protobuf and psutil below what vLLM runs with here)."""
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        assert http.get("/v2/health/live").json() == {"live": True}
        assert http.get("/v2/health/ready").json() == {"ready": True}
        assert http.get("/v2/models/a1/ready").json() == {"name": "a1", "ready": True}
        versioned = http.get("/v2/models/tiny/versions/1/ready")
        assert versioned.json() == {"name": "tiny", "ready": True}


def test_server_metadata_advertises_implemented_extensions(
    client: triton.InferenceServerClient,
) -> None:
    metadata = client.get_server_metadata()
    assert {"binary_tensor_data", "statistics", "model_configuration", "generate"} <= set(
        metadata["extensions"]
    )
    assert "cuda_shared_memory" not in metadata["extensions"]


def test_repository_index_over_http_lists_every_model(
    client: triton.InferenceServerClient, http: httpx.Client
) -> None:
    """tritonclient's `get_model_repository_index` (POST /v2/repository/index, no body) and
    Triton's optional `{"ready": true}`; a body that is not an object is Triton's 400."""
    index = client.get_model_repository_index()
    assert {"tiny", "a1", "a2"} <= {m["name"] for m in index}
    assert all(m["state"] == "READY" and m["version"] == "1" for m in index)
    assert http.post("/v2/repository/index", json={"ready": True}).json() == index
    for bad in ([1], {"ready": "yes"}):
        refused = http.post("/v2/repository/index", json=bad)
        assert refused.status_code == 400 and "error" in refused.json(), refused.text


def test_model_metadata_and_config(client: triton.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("a1", model_version="1")
    assert (metadata["name"], metadata["versions"], metadata["platform"]) == ("a1", ["1"], "vllm")
    assert metadata["inputs"][0] == {"name": "text_input", "datatype": "BYTES", "shape": [1]}
    assert metadata["outputs"][0] == {"name": "text_output", "datatype": "BYTES", "shape": [-1]}
    config = client.get_model_config("tiny")
    assert config["backend"] == "vllm" and config["max_batch_size"] == 0
    assert config["input"][0]["data_type"] == "TYPE_STRING"
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("nope")
    assert caught.value.status() == "404"
    assert caught.value.message() == "Request for unknown model: 'nope' is not found"


# ---- infer with tritonclient ---------------------------------------------------------------------
def test_infer_binary_and_json_encodings_agree(client: triton.InferenceServerClient) -> None:
    binary = client.infer("tiny", text_inputs(PROMPT, greedy()))
    assert binary.get_response()["model_name"] == "tiny"
    json_outputs = [triton.InferRequestedOutput("text_output", binary_data=False)]
    plain = client.infer("tiny", text_inputs(PROMPT, greedy(), binary=False), outputs=json_outputs)
    assert "data" in plain.get_output("text_output")
    assert binary.get_output("text_output")["parameters"]["binary_data_size"] > 4
    text = binary.as_numpy("text_output")[0].decode()
    assert text and plain.as_numpy("text_output")[0] == text  # JSON BYTES come back as str


def test_infer_accepts_compressed_requests(client: triton.InferenceServerClient) -> None:
    plain = client.infer("tiny", text_inputs(PROMPT, greedy())).as_numpy("text_output")[0]
    for algorithm in ("gzip", "deflate"):
        packed = client.infer("tiny", text_inputs(PROMPT, greedy()),
                              request_compression_algorithm=algorithm)
        assert packed.as_numpy("text_output")[0] == plain


def test_infer_prepends_the_prompt_unless_excluded(client: triton.InferenceServerClient) -> None:
    excluded = client.infer("tiny", text_inputs(PROMPT, greedy())).as_numpy("text_output")[0]
    full = client.infer("tiny", text_inputs(PROMPT, greedy(), exclude=False))
    assert full.as_numpy("text_output")[0].decode() == PROMPT + excluded.decode()


def test_infer_outputs_requested_both_ways(client: triton.InferenceServerClient) -> None:
    outputs = [
        triton.InferRequestedOutput("text_output", binary_data=True),
        triton.InferRequestedOutput("finish_reason", binary_data=False),
        triton.InferRequestedOutput("num_output_tokens", binary_data=True),
        triton.InferRequestedOutput("num_input_tokens", binary_data=False),
    ]
    result = client.infer("tiny", text_inputs(PROMPT, greedy(5)), outputs=outputs,
                          request_id="tc-outputs")
    response = result.get_response()
    assert response["id"] == "tc-outputs"
    assert [o["name"] for o in response["outputs"]] == [
        "text_output", "finish_reason", "num_output_tokens", "num_input_tokens"
    ]
    assert result.as_numpy("finish_reason").tolist() == ["length"]  # JSON BYTES come as str
    assert result.as_numpy("num_output_tokens").tolist() == [5]
    assert result.as_numpy("num_input_tokens")[0] > 0


def test_adapter_output_equals_openai_completions_for_the_adapter(
    client: triton.InferenceServerClient, http: httpx.Client
) -> None:
    via_triton = client.infer("a1", text_inputs(PROMPT, greedy(10))).as_numpy("text_output")
    text = via_triton[0].decode()
    r = http.post("/v1/completions", json={
        "model": "a1", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
    })
    if r.status_code == 200:
        assert r.json()["choices"][0]["text"] == text
    else:  # the OpenAI module not being served: the same adapter through lora_name
        r = http.post("/v2/models/tiny/generate", json={
            "text_input": PROMPT, "exclude_input_in_output": True,
            "parameters": {**greedy(10), "lora_name": "a1"},
        })
        assert r.json()["text_output"] == text
    base = client.infer("tiny", text_inputs(PROMPT, greedy(10))).as_numpy("text_output")
    assert base[0].decode() != text, "the adapter must change the output"


def test_lora_name_in_sampling_parameters_selects_the_adapter(
    client: triton.InferenceServerClient,
) -> None:
    by_path = client.infer("a2", text_inputs(PROMPT, greedy()))
    by_name = client.infer("tiny", text_inputs(PROMPT, {**greedy(), "lora_name": "a2"}))
    assert by_name.as_numpy("text_output")[0] == by_path.as_numpy("text_output")[0]
    with pytest.raises(InferenceServerException) as caught:
        client.infer("tiny", text_inputs(PROMPT, {**greedy(), "lora_name": "zz"}))
    assert caught.value.status() == "404" and "LoRA zz is not supported" in caught.value.message()


def test_inference_statistics_count_requests_per_model(
    client: triton.InferenceServerClient,
) -> None:
    before, _ = success_and_fail(client, "a1")
    client.infer("a1", text_inputs(PROMPT, greedy(2)))
    stats = client.get_inference_statistics(model_name="a1")["model_stats"][0]
    assert (stats["name"], stats["version"]) == ("a1", "1")
    assert stats["inference_stats"]["success"]["count"] == before + 1
    assert stats["inference_stats"]["compute_infer"]["ns"] > 0
    every = client.get_inference_statistics()["model_stats"]
    assert {"tiny", "a1", "a2"} <= {s["name"] for s in every}


def test_tritonclient_sees_triton_errors(client: triton.InferenceServerClient) -> None:
    bad = triton.InferInput("text_input", [1], "INT32")
    bad.set_data_from_numpy(np.array([1], dtype=np.int32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("tiny", [bad])
    assert caught.value.status() == "400"
    assert "expects 'BYTES'" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.infer("nope", text_inputs(PROMPT, greedy()))
    assert caught.value.status() == "404"


# ---- MindIE token infer --------------------------------------------------------------------------
def test_mindie_token_infer_generates_uint32_ids(http: httpx.Client) -> None:
    body = {"id": "tok-1", "inputs": [{
        "name": "input0", "shape": [1, 4], "datatype": "UINT32", "data": [5, 17, 42, 99],
        "parameters": {"max_new_tokens": 6, "do_sample": False, "ignore_eos": True},
    }], "outputs": [{"name": "output0"}]}
    r = http.post("/v2/models/tiny/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert (out["name"], out["datatype"], out["shape"]) == ("output0", "UINT32", [1, 6])
    assert all(isinstance(i, int) and i >= 0 for i in out["data"])
    again = http.post("/v2/models/tiny/infer", json=body).json()["outputs"][0]["data"]
    assert again == out["data"], "greedy token generation is deterministic"


# ---- the generate extension over raw HTTP --------------------------------------------------------
def test_generate_json_echoes_a_given_id_only(http: httpx.Client) -> None:
    body = {"id": "g-1", "text_input": PROMPT, "exclude_input_in_output": True,
            "return_finish_reason": True, "parameters": greedy(6)}
    r = http.post("/v2/models/a1/generate", content=json.dumps(body))  # no Content-Type
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    got = r.json()
    assert (got["id"], got["model_name"], got["model_version"]) == ("g-1", "a1", "1")
    assert got["finish_reason"] == "length" and isinstance(got["text_output"], str)
    r = http.post("/v2/models/a1/generate", json={**body, "id": ""})
    assert "id" not in r.json() and r.json()["text_output"] == got["text_output"]


def test_generate_takes_mindie_parameter_names(http: httpx.Client) -> None:
    vllm = http.post("/v2/models/tiny/generate", json={
        "text_input": PROMPT, "exclude_input_in_output": True,
        "parameters": {"max_tokens": 5, "temperature": 0, "ignore_eos": True},
    }).json()
    mindie = http.post("/v2/models/tiny/generate", json={
        "text_input": PROMPT, "exclude_input_in_output": True,
        "parameters": {"max_new_tokens": 5, "do_sample": False, "ignore_eos": True,
                       "details": True},
    }).json()
    assert mindie["text_output"] == vllm["text_output"]
    assert mindie["details"]["generated_tokens"] == 5


def test_generate_stream_frames_deltas_like_triton(http: httpx.Client) -> None:
    whole = http.post("/v2/models/tiny/generate", json={
        "text_input": PROMPT, "exclude_input_in_output": True, "parameters": greedy(12),
    }).json()["text_output"]
    r = http.post("/v2/models/tiny/generate_stream", json={
        "id": "s-1", "text_input": PROMPT, "stream": True, "parameters": greedy(12),
        "return_finish_reason": True,
    })
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_events(r.text)
    assert len(events) > 1 and "[DONE]" not in r.text
    assert all(e["id"] == "s-1" and e["model_name"] == "tiny" for e in events)
    assert [e["done"] for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["finish_reason"] == "length"
    assert "".join(e["text_output"] for e in events) == whole


def test_generate_stream_errors_before_start_are_json(http: httpx.Client) -> None:
    r = http.post("/v2/models/tiny/generate_stream",
                  json={"text_input": PROMPT, "parameters": {"lora_name": "zz"}})
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/json"
    assert "LoRA zz is not supported" in r.json()["error"]


# ---- cancellation: stopInfer and disconnects -----------------------------------------------------
def test_stop_infer_ends_a_long_stream_and_nothing_stays_in_flight(http: httpx.Client) -> None:
    body = {"id": "long-stop-1", "text_input": PROMPT, "stream": True,
            "parameters": {"max_tokens": 400, "ignore_eos": True, "temperature": 0}}
    events: list[dict[str, Any]] = []
    with http.stream("POST", "/v2/models/tiny/generate_stream", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                break
        stop = http.post("/v2/models/tiny/stopInfer", json={"id": "long-stop-1"})
        assert (stop.status_code, stop.json()) == (200, {"id": "long-stop-1"})
        events += [json.loads(x[len("data: "):]) for x in lines if x.startswith("data: ")]
    assert events[-1]["done"] is True
    assert len(events) < 400, "stopInfer must end generation early"
    idle = wait_idle(http)
    assert idle["free_slots"] == idle["total_slots"]
    again = http.post("/v2/models/tiny/stopInfer", json={"id": "long-stop-1"})
    assert again.status_code == 404
    assert again.json() == {"error": "RequestId is long-stop-1 not found.",
                            "error_type": "NotFoundError"}


def test_client_disconnect_aborts_a_stream(
    http: httpx.Client, client: triton.InferenceServerClient, server: RunningServer
) -> None:
    _, failed = success_and_fail(client, "a2")
    body = {"text_input": PROMPT, "stream": True,
            "parameters": {"max_tokens": 400, "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=60) as own, own.stream(
        "POST", "/v2/models/a2/generate_stream", json=body
    ) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    assert json.loads(first[len("data: "):])["done"] is False
    idle = wait_idle(http)
    assert idle["free_slots"] == idle["total_slots"]
    assert success_and_fail(client, "a2")[1] == failed + 1


def test_client_disconnect_aborts_a_non_streaming_generate(
    http: httpx.Client, client: triton.InferenceServerClient, server: RunningServer
) -> None:
    succeeded, failed = success_and_fail(client, "a2")
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 400, "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=0.3) as own, pytest.raises(httpx.ReadTimeout):
        own.post("/v2/models/a2/generate", json=body)
    idle = wait_idle(http)
    assert idle["free_slots"] == idle["total_slots"]
    assert success_and_fail(client, "a2") == (succeeded, failed + 1)


# ---- bad input on every route --------------------------------------------------------------------
TEXT = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [PROMPT]}
BAD_POSTS: list[tuple[str, Any, dict[str, str], int, str]] = [
    ("/v2/models/tiny/generate",
     {"text_input": "x", "parameters": {"sampling_parameters": '{"max_tokens": 3}'}}, {}, 400,
     "Unexpected keyword argument 'sampling_parameters'"),
    ("/v2/models/tiny/infer", b"{oops", {}, 400, "not valid JSON"),
    ("/v2/models/tiny/infer", {"inputs": [{**TEXT, "datatype": "FP32", "data": [1.0]}]}, {}, 400,
     "expects 'BYTES'"),
    ("/v2/models/tiny/infer", {"inputs": [{**TEXT, "shape": [3]}]}, {}, 400,
     "expects 3 element(s)"),
    ("/v2/models/tiny/infer", {"inputs": [{"name": "stream", "shape": [1], "datatype": "BOOL",
                                           "data": [False]}]}, {}, 400, "['text_input']"),
    ("/v2/models/tiny/infer", {"inputs": [TEXT], "parameters": {"max_tokens": -4}}, {}, 400,
     "at least 1"),
    ("/v2/models/tiny/infer", {"inputs": [TEXT]}, {"Inference-Header-Content-Length": "99999"},
     400, "inference header size"),
    ("/v2/models/nope/infer", {"inputs": [TEXT]}, {}, 404, "unknown model: 'nope'"),
    ("/v2/models/tiny/generate", b"[1,", {}, 400, "not valid JSON"),
    ("/v2/models/tiny/generate", {"text_input": 12}, {}, 400, "non-string as string"),
    ("/v2/models/tiny/generate", {"text_input": "x", "parameters": {"max_tokens": -1}}, {}, 400,
     "at least 1"),
    ("/v2/models/tiny/generate", {"text_input": "x", "stop": [str(i) for i in range(40)]}, {},
     400, "parameter 'stop' must have at most"),
    ("/v2/models/tiny/generate", {"parameters": {"max_tokens": 3}}, {}, 400, "['text_input']"),
    ("/v2/models/nope/generate", {"text_input": "x"}, {}, 404, "unknown model: 'nope'"),
    ("/v2/models/tiny/generate_stream", b"", {}, 400, "empty"),
    ("/v2/models/tiny/generate_stream", {"text_input": "x", "stream": 1}, {}, 400,
     "non-boolean as boolean"),
    ("/v2/models/tiny/generate_stream",
     {"text_input": "x", "stream": True, "exclude_input_in_output": False},
     {}, 400, "exclude_input_in_output"),
    ("/v2/models/tiny/versions/7/generate_stream", {"text_input": "x"}, {}, 404, "version 7"),
    # stopInfer is MindIE's own route: its 422 (single_req_infer_interface_base.cpp)
    ("/v2/models/tiny/stopInfer", b"not json", {}, 422, "Failed to parse context to json"),
    ("/v2/models/tiny/stopInfer", {"id": 5}, {}, 422, "id must be string type."),
    ("/v2/models/nope/stopInfer", {"id": "x"}, {}, 404, "unknown model: 'nope'"),
]


@pytest.mark.parametrize(("path", "body", "headers", "status", "message"), BAD_POSTS)
def test_bad_input_gets_a_triton_error_and_the_engine_keeps_serving(
    http: httpx.Client, path: str, body: Any, headers: dict[str, str], status: int, message: str
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers=headers)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert list(r.json()) in (["error"], ["error", "error_type"])
    assert message in r.json()["error"]
    ok = http.post("/v2/models/tiny/generate", json={"text_input": "ok", "max_tokens": 1})
    assert ok.status_code == 200


def test_engine_bounds_are_triton_400s(http: httpx.Client) -> None:
    cases = [
        ("/v2/models/tiny/generate", {"text_input": "x", "parameters": {"max_tokens": 100000}}),
        ("/v2/models/tiny/generate", {"text_input": "word " * 2000}),
        ("/v2/models/tiny/generate_stream", {"text_input": "word " * 2000}),
        ("/v2/models/tiny/infer", {"inputs": [{"name": "ids", "shape": [2], "datatype": "UINT32",
                                               "data": [1, 10**6]}]}),
    ]
    for path, body in cases:
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert r.headers["content-type"] == "application/json" and r.json()["error"]
    huge = b'{"text_input": "' + b"a" * (2 << 20) + b'"}'
    r = http.post("/v2/models/tiny/generate", content=huge)
    assert r.status_code == 413 and "larger than the limit" in r.json()["error"]
    ok = http.post("/v2/models/tiny/generate", json={"text_input": "ok", "max_tokens": 1})
    assert ok.status_code == 200


def test_unicode_and_empty_prompts(http: httpx.Client) -> None:
    for prompt in ("héllo wörld 🦊 — ✓", ""):
        r = http.post("/v2/models/tiny/generate", json={
            "text_input": prompt, "parameters": {"max_tokens": 4, "temperature": 0},
        })
        assert r.status_code == 200, r.text
        assert r.json()["text_output"].startswith(prompt)


@pytest.mark.parametrize(
    "path",
    ["/v2/models/nope", "/v2/models/nope/config", "/v2/models/nope/ready", "/v2/models/nope/stats",
     "/v2/models/nope/getSlotCount", "/v2/models/tiny/versions/9"],
)
def test_unknown_models_are_404_on_every_get_route(http: httpx.Client, path: str) -> None:
    r = http.get(path)
    assert r.status_code == 404
    assert r.json()["error"].startswith("Request for unknown model: ")
