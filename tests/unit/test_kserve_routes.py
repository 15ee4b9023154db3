"""Triton / KServe v2 routes in process, on the fake engine: wire shapes, errors, stats, cancel.

The real-engine and official-client proofs are in tests/conformance/test_triton_clients.py.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from protocols.kserve_v2.routes import routes
from server.core.adapter_files import AdapterRules, BaseModelShape
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.core.lifecycle import Lifecycle
from server.core.service import InferenceService, Limits
from server.engines.fake import FakeEngine, FakeScript
from server.http.app import ListenerApp
from server.http.context import ProtocolContext, RequestBounds
from tests.unit.demo_kit import unit_demo
from tests.unit.gateway_kit import routes_app

pytestmark = pytest.mark.anyio


class App:
    def __init__(self, client: httpx.AsyncClient, engine: FakeEngine, service: InferenceService):
        self.client = client
        self.engine = engine
        self.service = service


async def build(
    script: FakeScript | None = None,
) -> tuple[ListenerApp, FakeEngine, InferenceService]:
    demo = unit_demo()
    engine = FakeEngine(script, model_name="tiny")
    lifecycle = Lifecycle()
    lifecycle.ready()
    rules = AdapterRules(
        roots=(str(demo),), max_rank=8, base_names=frozenset({"tiny"}),
        base_shape=BaseModelShape.from_model_dir(str(demo / "model")),
    )
    registry = AdapterRegistry(
        engine=engine, rules=rules,
        limits=AdapterLimits(enabled=True, max_loras=2, max_cpu_loras=4),
    )
    for name in ("a1", "a2"):
        await registry.register(name, str(demo / "adapters" / name))
    service = InferenceService(
        engine=engine, adapters=registry, lifecycle=lifecycle, limits=Limits(),
        base_names=["tiny"],
    )
    ctx = ProtocolContext(
        service=service, max_body_bytes=1 << 20, server_version="9.9.9",
        bounds=RequestBounds(max_stop_sequences=4),
    )
    return routes_app(routes(ctx)), engine, service


@pytest.fixture
async def app() -> AsyncIterator[App]:
    starlette, engine, service = await build()
    transport = httpx.ASGITransport(app=starlette)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        yield App(client, engine, service)


def text_infer(prompt: str = "a b c", **params: object) -> dict[str, object]:
    return {
        "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [prompt]}],
        "parameters": params,
    }


def binary_body(header: dict[str, object], *blobs: bytes) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(header).encode()
    return head + b"".join(blobs), {"Inference-Header-Content-Length": str(len(head))}


async def wait_until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def bytes_element(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


# ---- health, metadata, config ------------------------------------------------------------------
async def test_server_metadata_lists_only_implemented_extensions(app: App) -> None:
    r = await app.client.get("/v2")
    assert r.status_code == 200
    assert r.json() == {
        "name": "llm-gateway", "version": "9.9.9",
        "extensions": ["binary_tensor_data", "parameters", "statistics", "model_configuration",
                       "generate"],
    }


async def test_health_routes_answer_the_open_inference_protocol_bodies(app: App) -> None:
    """What KServe's InferenceRESTClient reads (`live`, `ready`); tritonclient reads the status."""
    expected = {
        "/v2/health/live": {"live": True},
        "/v2/health/ready": {"ready": True},
        "/v2/models/tiny/ready": {"name": "tiny", "ready": True},
        "/v2/models/a1/versions/1/ready": {"name": "a1", "ready": True},
    }
    for path, body in expected.items():
        r = await app.client.get(path)
        assert (r.status_code, r.json()) == (200, body), path
        assert r.headers["content-type"] == "application/json"


async def test_readiness_is_400_and_false_when_not_accepting(app: App) -> None:
    app.service.lifecycle.begin_drain()
    r = await app.client.get("/v2/health/ready")
    assert (r.status_code, r.json()) == (400, {"ready": False})
    r = await app.client.get("/v2/models/tiny/ready")
    assert (r.status_code, r.json()) == (400, {"name": "tiny", "ready": False})
    r = await app.client.get("/v2/health/live")
    assert (r.status_code, r.json()) == (200, {"live": True})


async def test_unknown_model_and_version_return_404_in_triton_words(app: App) -> None:
    r = await app.client.get("/v2/models/nope")
    assert r.status_code == 404
    assert r.json() == {"error": "Request for unknown model: 'nope' is not found"}
    r = await app.client.get("/v2/models/tiny/versions/2/config")
    assert r.json() == {"error": "Request for unknown model: 'tiny' version 2 is not found"}
    r = await app.client.post("/v2/models/nope/generate", json={"text_input": "x"})
    assert r.status_code == 404


async def test_model_metadata_has_the_vllm_backend_tensors(app: App) -> None:
    r = await app.client.get("/v2/models/a1/versions/1")
    body = r.json()
    assert (body["name"], body["versions"], body["platform"]) == ("a1", ["1"], "vllm")
    assert body["inputs"][0] == {"name": "text_input", "datatype": "BYTES", "shape": [1]}
    assert {"name": "stream", "datatype": "BOOL", "shape": [1]} in body["inputs"]
    assert [o["name"] for o in body["outputs"]] == [
        "text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
        "num_output_tokens",
    ]


async def test_model_config_uses_triton_type_names(app: App) -> None:
    body = (await app.client.get("/v2/models/tiny/config")).json()
    assert body["backend"] == "vllm" and body["max_batch_size"] == 0
    assert body["input"][0]["data_type"] == "TYPE_STRING"
    assert body["input"][0]["optional"] is False
    assert body["model_transaction_policy"] == {"decoupled": True}
    assert {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1],
            "label_filename": "", "is_shape_tensor": False} in body["output"]


# ---- infer ---------------------------------------------------------------------------------------
async def test_infer_json_prepends_the_prompt_by_default(app: App) -> None:
    r = await app.client.post("/v2/models/tiny/infer", json={**text_infer("a b", max_tokens=3),
                                                             "id": "q1"})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert (body["id"], body["model_name"], body["model_version"]) == ("q1", "tiny", "1")
    assert body["outputs"] == [
        {"name": "text_output", "datatype": "BYTES", "shape": [1], "data": ["a ba b a "]}
    ]


async def test_infer_without_id_omits_it(app: App) -> None:
    r = await app.client.post("/v2/models/tiny/infer", json=text_infer(max_tokens=1))
    assert "id" not in r.json()


async def test_infer_binary_request_and_binary_outputs(app: App) -> None:
    header = {
        "inputs": [
            {"name": "text_input", "shape": [1], "datatype": "BYTES",
             "parameters": {"binary_data_size": 7}},
            {"name": "exclude_input_in_output", "shape": [1], "datatype": "BOOL",
             "parameters": {"binary_data_size": 1}},
        ],
        "outputs": [{"name": "text_output", "parameters": {"binary_data": True}},
                    {"name": "num_output_tokens", "parameters": {"binary_data": False}}],
        "parameters": {"max_tokens": 2},
    }
    content, headers = binary_body(header, bytes_element(b"x y"), b"\x01")
    r = await app.client.post("/v2/models/a1/infer", content=content, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    length = int(r.headers["inference-header-content-length"])
    head = json.loads(r.content[:length])
    text, count = head["outputs"]
    assert text["parameters"] == {"binary_data_size": 4 + len("[a1] y ")}
    assert "data" not in text
    assert r.content[length:] == bytes_element(b"[a1] y ")
    assert count == {"name": "num_output_tokens", "datatype": "UINT32", "shape": [1], "data": [2]}


async def test_binary_data_output_applies_to_unlisted_outputs(app: App) -> None:
    body = text_infer(max_tokens=1, binary_data_output=True)
    r = await app.client.post("/v2/models/tiny/infer", json=body)
    length = int(r.headers["inference-header-content-length"])
    assert json.loads(r.content[:length])["outputs"][0]["parameters"]["binary_data_size"] > 4


async def test_requested_extra_outputs_are_produced(app: App) -> None:
    body = {**text_infer("a b", max_tokens=2),
            "outputs": [{"name": "finish_reason"}, {"name": "num_input_tokens"},
                        {"name": "text_output"}]}
    outputs = (await app.client.post("/v2/models/tiny/infer", json=body)).json()["outputs"]
    assert [(o["name"], o["data"]) for o in outputs] == [
        ("finish_reason", ["length"]), ("num_input_tokens", [2]), ("text_output", ["a ba b "]),
    ]


async def test_sampling_parameters_tensor_selects_lora_and_knobs(app: App) -> None:
    body = text_infer("p q")
    body["inputs"].append({  # type: ignore[attr-defined]
        "name": "sampling_parameters", "shape": [1], "datatype": "BYTES",
        "data": [json.dumps({"max_tokens": "2", "lora_name": "a2"})],
    })
    r = await app.client.post("/v2/models/tiny/infer", json=body)
    assert r.json()["outputs"][0]["data"] == ["p q[a2] q "]
    assert app.engine.requests[-1].sampling.max_new_tokens == 2


async def test_mindie_token_infer_returns_uint32_ids(app: App) -> None:
    body = {"id": "t-1", "inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32",
                                     "data": [5, 6, 7], "parameters": {"max_new_tokens": 2}}],
            "outputs": [{"name": "output0"}]}
    r = await app.client.post("/v2/models/tiny/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"]
    assert len(out) == 1 and out[0]["name"] == "output0" and out[0]["datatype"] == "UINT32"
    assert out[0]["shape"] == [1, 2] and len(out[0]["data"]) == 2
    assert r.json()["id"] == "t-1"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"inputs": [{"name": "text_input", "shape": [1], "datatype": "INT32", "data": [1]}]},
         "data-type is 'INT32', but model 'tiny' expects 'BYTES'"),
        ({"inputs": [{"name": "text_input", "shape": [2], "datatype": "BYTES",
                      "data": ["a"]}]}, "expects 2 element(s) but 'data' has 1"),
        ({"inputs": [{"name": "text_input", "shape": [2], "datatype": "BYTES",
                      "data": ["a", "b"]}]}, "unexpected shape for input 'text_input'"),
        ({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [3]}]},
         "attempt to access JSON non-string as string"),
        ({"inputs": [{"name": "stream", "shape": [1], "datatype": "BOOL", "data": [False]}]},
         "missing required input(s) ['text_input']"),
        ({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES"}]},
         "But no field is set"),
        ({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a"]},
                     {"name": "stream", "shape": [1], "datatype": "BOOL", "data": [True]}]},
         "use generate_stream"),
        ({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a"]}],
          "parameters": {"max_tokens": -1}}, "'max_tokens' must be at least 1"),
        ({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a"]}],
          "outputs": [{"name": "nope"}]}, "unexpected inference output 'nope'"),
        ({"inputs": [{"name": "text_input", "shape": [-1], "datatype": "BYTES",
                      "data": ["a"]}]}, "inputs.0.shape.0"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "WAT", "data": ["a"]}]},
         "invalid datatype 'WAT'"),
        ({"inputs": "nope"}, "validation error"),
    ],
)
async def test_bad_infer_bodies_are_triton_400s(app: App, body: object, message: str) -> None:
    r = await app.client.post("/v2/models/tiny/infer", json=body)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    assert message in r.json()["error"]
    assert list(r.json()) == ["error"]


@pytest.mark.parametrize(
    ("content", "headers", "message"),
    [
        (b"{not json", {}, "not valid JSON"),
        (b"", {}, "empty"),
        (b'{"inputs": []}', {"Inference-Header-Content-Length": "999"},
         "inference header size should be in range"),
        (b'{"inputs": []}', {"Inference-Header-Content-Length": "x1"}, "Unable to parse"),
        (b'{"inputs": []}', {"Inference-Header-Content-Length": "0"}, "raw binary requests"),
    ],
)
async def test_bad_infer_framing_is_a_triton_400(
    app: App, content: bytes, headers: dict[str, str], message: str
) -> None:
    r = await app.client.post("/v2/models/tiny/infer", content=content, headers=headers)
    assert r.status_code == 400
    assert message in r.json()["error"]


async def test_binary_sizes_must_match_the_body(app: App) -> None:
    header = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                          "parameters": {"binary_data_size": 50}}]}
    content, headers = binary_body(header, bytes_element(b"abc"))
    r = await app.client.post("/v2/models/tiny/infer", content=content, headers=headers)
    assert r.status_code == 400 and "additional bytes" in r.json()["error"]
    content, headers = binary_body({**header, "inputs": [
        {**header["inputs"][0], "parameters": {"binary_data_size": 7}}]},  # type: ignore[index]
        bytes_element(b"abc"), b"extra")
    r = await app.client.post("/v2/models/tiny/infer", content=content, headers=headers)
    assert r.status_code == 400 and "unexpected additional input data" in r.json()["error"]


# ---- generate ------------------------------------------------------------------------------------
async def test_generate_is_flat_and_echoes_a_given_id(app: App) -> None:
    r = await app.client.post(
        "/v2/models/tiny/generate", content=json.dumps({
            "id": "42", "text_input": "u v", "parameters": {"max_tokens": 2},
            "exclude_input_in_output": True, "return_num_output_tokens": True,
        }),
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"id": "42", "model_name": "tiny", "model_version": "1",
                        "text_output": "u v ", "num_output_tokens": 2}


async def test_generate_omits_an_empty_id_and_takes_mindie_names(app: App) -> None:
    r = await app.client.post("/v2/models/a1/generate", json={
        "id": "", "text_input": "u v",
        "parameters": {"max_new_tokens": 1, "do_sample": False, "details": True},
    })
    body = r.json()
    assert "id" not in body
    assert body["text_output"] == "u v[a1] "
    assert body["details"]["finish_reason"] == "length"
    assert body["details"]["generated_tokens"] == 1
    assert app.engine.requests[-1].sampling.temperature == 0.0


async def test_generate_top_level_unknown_keys_are_parameters(app: App) -> None:
    await app.client.post("/v2/models/tiny/generate", json={"text_input": "a", "max_tokens": 3})
    assert app.engine.requests[-1].sampling.max_new_tokens == 3


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"text_input": 5}, 400, "attempt to access JSON non-string as string"),
        ({"text_input": "a", "stream": "false"}, 400, "non-boolean as boolean"),
        ({"stream": False}, 400, "missing required input(s) ['text_input']"),
        ({}, 400, "expected number of inputs between 1 and 9 but got 0"),
        ({"text_input": "a", "parameters": []}, 400, "Expected JSON object for keyword"),
        ({"text_input": "a", "parameters": {"x": {"y": 1}}}, 400, "has invalid type"),
        ({"text_input": "a", "parameters": {"max_tokens": -3}}, 400, "at least 1"),
        ({"text_input": "a", "parameters": {"temperature": "hot"}}, 400, "finite number"),
        ({"text_input": "a", "stop": ["1", "2", "3", "4", "5"]}, 400, "at most 4 strings"),
        ({"text_input": "a", "parameters": {"lora_name": "zz"}}, 404, "LoRA zz is not supported"),
        ({"text_input": "a", "stream": True}, 400, "exactly 1 response"),
        ({"text_input": ["a", "b"]}, 400, "unexpected shape"),
        ([1, 2], 400, "JSON object"),
    ],
)
async def test_bad_generate_bodies(app: App, body: object, status: int, message: str) -> None:
    for route in ("generate", "generate_stream"):
        if route == "generate_stream" and "exactly 1 response" in message:
            continue
        r = await app.client.post(f"/v2/models/tiny/{route}", json=body)
        assert r.status_code == status, (route, r.text)
        assert r.headers["content-type"] == "application/json"
        assert message in r.json()["error"]
    ok = await app.client.post("/v2/models/tiny/generate", json={"text_input": "still fine"})
    assert ok.status_code == 200


async def test_generate_stream_frames_deltas_and_marks_the_last(app: App) -> None:
    r = await app.client.post("/v2/models/tiny/generate_stream", json={
        "id": "s1", "text_input": "m n", "stream": True, "parameters": {"max_tokens": 3},
        "return_finish_reason": True,
    })
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert r.text.endswith("\n\n") and "[DONE]" not in r.text
    frames = r.text.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames)
    events = [json.loads(f[len("data: "):]) for f in frames]
    assert "".join(e["text_output"] for e in events) == "m n m "
    assert [e["done"] for e in events][-1] is True
    assert all(e["id"] == "s1" and e["model_name"] == "tiny" for e in events)
    assert events[-1]["finish_reason"] == "length"
    assert "finish_reason" not in events[0] or events[0]["done"]


async def test_generate_stream_with_stream_false_sends_one_whole_event(app: App) -> None:
    r = await app.client.post("/v2/models/tiny/generate_stream", json={
        "text_input": "m n", "stream": False, "parameters": {"max_tokens": 2},
    })
    frames = r.text.split("\n\n")[:-1]
    assert len(frames) == 1
    event = json.loads(frames[0][len("data: "):])
    assert event["text_output"] == "m nm n " and event["done"] is True


async def test_stream_error_after_start_is_an_in_band_event() -> None:
    starlette, _, _ = await build(FakeScript(fail_after=2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=starlette),
                                 base_url="http://t") as client:
        r = await client.post("/v2/models/tiny/generate_stream",
                              json={"text_input": "a b", "stream": True, "max_tokens": 5})
    assert r.status_code == 200
    last = json.loads(r.text.split("\n\n")[-2][len("data: "):])
    assert last == {"error": "scripted failure"}


# ---- stopInfer, slots, stats --------------------------------------------------------------------
async def test_stop_infer_cancels_a_running_stream() -> None:
    starlette, _, service = await build(FakeScript(hang_after=1))
    transport = httpx.ASGITransport(app=starlette)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        async def stream() -> str:
            r = await client.post("/v2/models/tiny/generate_stream",
                                  json={"id": "long-1", "text_input": "a b", "stream": True,
                                        "max_tokens": 400})
            return r.text

        running = asyncio.ensure_future(stream())
        await wait_until(lambda: service.is_active("long-1"))
        r = await client.post("/v2/models/tiny/stopInfer", json={"id": "long-1"})
        assert (r.status_code, r.json()) == (200, {"id": "long-1"})
        text = await asyncio.wait_for(running, 5)
        slots = (await client.get("/v2/models/tiny/getSlotCount")).json()
    last = json.loads(text.split("\n\n")[-2][len("data: "):])
    assert last["done"] is True
    assert not service.is_active("long-1")
    assert slots["free_slots"] == slots["total_slots"] == 32


async def test_stop_infer_unknown_id_is_mindie_404(app: App) -> None:
    r = await app.client.post("/v2/models/tiny/stopInfer", json={"id": "ghost"})
    assert r.status_code == 404
    assert r.json() == {"error": "RequestId is ghost not found.", "error_type": "NotFoundError"}
    r = await app.client.post("/v2/models/tiny/stopInfer", json={"id": "bad.id"})
    assert r.status_code == 422  # MindIE's pattern (single_req_infer_interface_base.cpp)
    assert r.json()["error_type"] == "Input Validation Error"


async def test_get_slot_count_shape(app: App) -> None:
    r = await app.client.get("/v2/models/a1/getSlotCount")
    assert r.json() == {"total_slots": 32, "free_slots": 32, "available_tokens_length": 1024 * 16}


async def test_stats_count_success_and_failure_per_model(app: App) -> None:
    await app.client.post("/v2/models/a1/generate", json={"text_input": "a", "max_tokens": 1})
    await app.client.post("/v2/models/a1/generate", json={"text_input": "a", "max_tokens": -1})
    await app.client.post("/v2/models/tiny/infer", json=text_infer(max_tokens=1))
    stats = (await app.client.get("/v2/models/a1/versions/1/stats")).json()["model_stats"]
    assert len(stats) == 1
    a1 = stats[0]
    assert (a1["name"], a1["version"], a1["inference_count"]) == ("a1", "1", 1)
    infer = a1["inference_stats"]
    assert infer["success"]["count"] == 1 and infer["success"]["ns"] > 0
    assert infer["fail"]["count"] == 1
    assert infer["compute_infer"]["count"] == 1 and infer["queue"]["count"] == 1
    assert a1["last_inference"] > 0
    every = (await app.client.get("/v2/models/stats")).json()["model_stats"]
    assert [s["name"] for s in every] == ["tiny", "a1", "a2"]
    assert every[0]["inference_stats"]["success"]["count"] == 1
    assert every[2]["inference_count"] == 0


async def test_bodies_without_content_type_are_accepted(app: App) -> None:
    r = await app.client.post(
        "/v2/models/tiny/generate", content=b'{"text_input": "a", "max_tokens": 1}',
        headers={"content-type": ""},
    )
    assert r.status_code == 200


async def test_gzip_request_bodies_are_inflated(app: App) -> None:
    import gzip

    content = gzip.compress(json.dumps(text_infer(max_tokens=1)).encode())
    r = await app.client.post("/v2/models/tiny/infer", content=content,
                              headers={"content-encoding": "gzip"})
    assert r.status_code == 200, r.text


def test_demo_assets_exist() -> None:
    assert Path(unit_demo() / "adapters" / "a1").is_dir()
