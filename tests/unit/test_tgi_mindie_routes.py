"""TGI and MindIE routes in process, on the fake engine: readiness, in-band stream errors,
admission (429) and engine aborts. Real-engine and official-client proofs are in
tests/conformance/test_tgi_clients.py and tests/conformance/test_mindie_http.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from protocols.mindie import errors as mindie_errors
from protocols.mindie import routes as mindie
from protocols.tgi import routes as tgi
from server.core.adapter_files import AdapterRules, BaseModelShape
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.core.lifecycle import Lifecycle
from server.core.service import InferenceService, Limits
from server.engines.fake import FakeEngine, FakeScript
from server.http.app import ListenerApp
from server.http.context import ProtocolContext
from server.http.routes import RouteList
from tests.unit.demo_kit import unit_demo
from tests.unit.gateway_kit import client as gateway_client
from tests.unit.gateway_kit import make_gateway, routes_app

pytestmark = pytest.mark.anyio


def build(
    script: FakeScript | None = None, *, ready: bool = True, limits: Limits | None = None
) -> tuple[ListenerApp, FakeEngine, InferenceService]:
    demo = unit_demo()
    engine = FakeEngine(script, model_name="tiny")
    lifecycle = Lifecycle()
    if ready:
        lifecycle.ready()
    rules = AdapterRules(
        roots=(str(demo),),
        max_rank=8,
        base_names=frozenset({"tiny"}),
        base_shape=BaseModelShape.from_model_dir(str(demo / "model")),
    )
    registry = AdapterRegistry(
        engine=engine, rules=rules, limits=AdapterLimits(enabled=True, max_loras=2, max_cpu_loras=4)
    )
    service = InferenceService(
        engine=engine,
        adapters=registry,
        lifecycle=lifecycle,
        limits=limits or Limits(),
        base_names=["tiny"],
    )
    ctx = ProtocolContext(service=service, max_body_bytes=1 << 20)
    mindie_generate = RouteList(owner="mindie", render=mindie_errors.render)
    mindie_generate.post("/mindie_generate", mindie.vllm_generate(ctx))
    routes = [*tgi.routes(ctx), *mindie.routes(ctx), *mindie_generate.routes]
    return routes_app(routes), engine, service


def client(app: ListenerApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def frames(text: str) -> list[dict[str, object]]:
    return [json.loads(f[len("data: ") :]) for f in text.split("\n\n") if f]


async def test_tgi_health_is_503_with_tgi_body_until_ready() -> None:
    app, _, service = build(ready=False)
    async with client(app) as http:
        for path in ("/health", "/"):
            response = await http.get(path)
            assert response.status_code == 503
            assert response.json() == {"error": "unhealthy", "error_type": "healthcheck"}
        service.lifecycle.ready()
        assert (await http.get("/health")).status_code == 200


async def test_generation_before_ready_is_refused_in_each_envelope() -> None:
    app, _, _ = build(ready=False)
    async with client(app) as http:
        tgi_answer = await http.post("/generate", json={"inputs": "a b"})
        mindie_answer = await http.post("/infer", json={"inputs": "a b"})
    assert tgi_answer.status_code == mindie_answer.status_code == 503
    assert mindie_answer.json()["error_type"] == "Service Unavailable"
    assert "retry-after" in tgi_answer.headers


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate_stream", {"inputs": "a b c", "parameters": {"max_new_tokens": 8}}),
        ("/infer", {"inputs": "a b c", "stream": True, "parameters": {"max_new_tokens": 8}}),
    ],
)
async def test_an_engine_failure_mid_stream_is_an_in_band_error(
    path: str, body: dict[str, object]
) -> None:
    app, _, _ = build(FakeScript(fail_after=2))
    async with client(app) as http:
        response = await http.post(path, json=body)
    assert response.status_code == 200
    events = frames(response.text)
    assert len(events) == 3 and "token" in events[0] and "token" in events[1]
    assert set(events[-1]) == {"error", "error_type"}


async def test_vllm_flavour_stream_failure_is_a_nul_terminated_error_chunk() -> None:
    app, _, _ = build(FakeScript(fail_after=1))
    async with client(app) as http:
        response = await http.post(
            "/mindie_generate", json={"prompt": "a b", "stream": True, "max_tokens": 5}
        )
    chunks = response.content.split(b"\0")
    assert chunks[-1] == b"" and json.loads(chunks[-2])["error_type"] == "Incomplete Generation"


async def test_a_full_server_answers_429_overloaded_with_retry_after() -> None:
    app, engine, _ = build(FakeScript(hang_after=0), limits=Limits(max_concurrent=1, max_queue=0))
    async with client(app) as http:
        hanging = asyncio.create_task(http.post("/generate", json={"inputs": "a"}))
        for _ in range(500):  # until the first request holds the only slot
            if engine.running:
                break
            await asyncio.sleep(0.01)
        tgi_answer = await http.post("/generate", json={"inputs": "a"})
        mindie_answer = await http.post("/infer", json={"inputs": "a"})
        hanging.cancel()
        with pytest.raises(asyncio.CancelledError):
            await hanging
    assert tgi_answer.status_code == 429
    assert tgi_answer.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    assert tgi_answer.headers["retry-after"] == "1"
    assert mindie_answer.status_code == 429


async def test_unknown_adapter_never_reaches_the_engine() -> None:
    app, engine, _ = build()
    async with client(app) as http:
        response = await http.post(
            "/generate", json={"inputs": "a", "parameters": {"adapter_id": "nope"}}
        )
    assert response.status_code == 422 and response.json()["error_type"] == "validation"
    assert not engine.requests


async def test_infer_uses_the_body_id_as_request_id() -> None:
    app, engine, _ = build()
    async with client(app) as http:
        await http.post("/infer", json={"id": "req-7", "inputs": "a b"})
    assert engine.requests[-1].request_id == "req-7"


async def test_tgi_stream_final_event_is_the_last_token() -> None:
    app, _, _ = build()
    async with client(app) as http:
        response = await http.post(
            "/generate_stream", json={"inputs": "a b", "parameters": {"max_new_tokens": 3}}
        )
    events = frames(response.text)
    assert len(events) == 3 and all(e["generated_text"] is None for e in events[:2])
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)


async def test_compat_route_prepends_the_prompt_unless_told_not_to() -> None:
    app, _, _ = build()
    body = {"inputs": "a b", "parameters": {"max_new_tokens": 3}}
    async with client(app) as http:
        plain = (await http.post("/generate", json=body)).json()["generated_text"]
        listed = (await http.post("/", json=body)).json()
        body["parameters"]["return_full_text"] = False
        told = (await http.post("/", json=body)).json()
        body["stream"], body["parameters"] = True, {"max_new_tokens": 3}
        streamed = frames((await http.post("/", json=body)).text)
    assert listed == [{"generated_text": "a b" + plain}]
    assert told == [{"generated_text": plain}]
    assert streamed[-1]["generated_text"] == "a b" + plain


# ---- SageMaker /invocations: TGI's with ProtocolConfig.tgiCompat, else DJL's -------------------
TGI_BODY = {"inputs": "a b", "parameters": {"max_new_tokens": 3}}


async def invocations(
    tgi_compat: bool, body: dict[str, object], path: str = "/invocations", **headers: str
) -> httpx.Response:
    gateway = make_gateway(overrides={"ProtocolConfig": {"tgiCompat": tgi_compat}})
    async with gateway_client(gateway, "data") as http:
        return await http.post(path, json=body, headers=headers)


async def test_invocations_answers_djls_object_by_default() -> None:
    response = await invocations(False, TGI_BODY)
    assert response.status_code == 200 and isinstance(response.json(), dict)


async def test_with_tgi_compat_invocations_answers_tgis_one_element_list_with_full_text() -> None:
    plain = (await invocations(True, TGI_BODY, "/generate")).json()["generated_text"]
    tgi = await invocations(True, TGI_BODY)
    assert tgi.status_code == 200
    assert tgi.json() == [{"generated_text": "a b" + plain}]
    streamed = await invocations(True, {**TGI_BODY, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert frames(streamed.text)[-1]["generated_text"] == tgi.json()[0]["generated_text"]


async def test_with_tgi_compat_djl_bodies_stay_djls() -> None:
    named = await invocations(True, {**TGI_BODY, "adapters": ""})
    assert isinstance(named.json(), dict) and "generated_text" in named.json()
    listed = await invocations(True, {**TGI_BODY, "inputs": ["a b", "c"]})
    assert isinstance(listed.json(), list) and len(listed.json()) == 2


async def test_with_tgi_compat_the_sagemaker_adapter_header_names_the_adapter() -> None:
    response = await invocations(
        True, TGI_BODY, **{"X-Amzn-SageMaker-Adapter-Identifier": "no-such"}
    )
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation"
    assert "adapter_id `no-such` is not a loaded adapter" in response.json()["error"]
