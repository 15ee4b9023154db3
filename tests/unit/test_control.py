"""The control router in process on the fake engine: every route, its bad input, and health in
each lifecycle state (the same checks run against the real server in tests/integration)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.core.errors import ServiceUnavailable
from server.core.lifecycle import Lifecycle, Role, State
from server.core.types import GenerationRequest, Sampling, TextPrompt
from server.engines.fake import FakeScript
from server.gateway import Gateway, starting_answers
from server.http.routes import MANAGEMENT
from server.runtime.process import StartingApp, drain
from tests.unit.gateway_kit import client, make_gateway

pytestmark = pytest.mark.anyio


def request(rid: str = "r", tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        model="",
        prompt=TextPrompt("one two three"),
        sampling=Sampling(max_new_tokens=tokens),
        stream=True,  # started requests are primed at their first token
        protocol="tgi",
    )


async def saturate(gateway: Gateway) -> list[asyncio.Task[object]]:
    """Fill every admission slot and the whole queue with hanging requests."""
    limits = gateway.service.limits
    tasks = [
        asyncio.create_task(gateway.service.start(request(f"h{i}")))
        for i in range(limits.max_concurrent + limits.max_queue)
    ]
    while not gateway.service.admission.saturated:  # noqa: ASYNC110 (no event to wait on)
        await asyncio.sleep(0.01)
    return tasks  # type: ignore[return-value]


# ---- health in each lifecycle state ------------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "live", "ready", "health"),
    [
        (State.READY, 200, 200, 200),
        (State.DRAINING, 200, 503, 503),
        (State.FAILED, 500, 500, 500),
    ],
)
async def test_health_family_follows_the_lifecycle(
    state: State, live: int, ready: int, health: int
) -> None:
    gateway = make_gateway()
    if state is State.DRAINING:
        gateway.lifecycle.begin_drain()
    elif state is State.FAILED:
        gateway.lifecycle.fail("engine is dead")
    async with client(gateway) as http:
        assert (await http.get("/v2/health/live")).status_code == live
        assert (await http.get("/v2/health/ready")).status_code == ready
        assert (await http.get("/health")).status_code == health
        assert (await http.get("/v2/models/tiny/ready")).status_code == health
        assert (await http.get("/v2/models/tiny/versions/1/ready")).status_code == health


async def test_draining_readiness_uses_mindie_stopped_envelope_with_retry_after() -> None:
    gateway = make_gateway()
    gateway.lifecycle.begin_drain()
    async with client(gateway) as http:
        response = await http.get("/v2/health/ready")
    assert response.json() == {
        "error": "The service has been stopped.",
        "error_type": "Service Unavailable",
    }
    assert response.headers["retry-after"] == "5"


async def test_failed_engine_liveness_names_the_failure() -> None:
    gateway = make_gateway()
    gateway.lifecycle.fail("engine core died")
    async with client(gateway) as http:
        response = await http.get("/v2/health/live")
    assert response.json() == {"message": "Service is abnormal: engine core died"}


async def test_saturated_admission_is_busy_live_200_ready_503() -> None:
    gateway = make_gateway(FakeScript(hang_after=0))
    tasks = await saturate(gateway)
    try:
        async with client(gateway) as http:
            live = await http.get("/v2/health/live")
            ready = await http.get("/v2/health/ready")
        assert (live.status_code, live.json()) == (200, {"message": "Service is alive but busy"})
        assert ready.status_code == 503
        assert ready.json()["message"].startswith("Service is alive but busy")
    finally:
        gateway.service.abort_all(ServiceUnavailable("test over"))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_unknown_model_ready_and_slot_count_are_404() -> None:
    async with client(make_gateway()) as http:
        for path in ("/v2/models/nope/ready", "/v2/models/nope/getSlotCount"):
            response = await http.get(path)
            assert response.status_code == 404
            assert response.json() == {
                "error": "Model nope not found.",
                "error_type": "NotFoundError",
            }


async def test_slot_count_reports_engine_slots_and_token_room() -> None:
    async with client(make_gateway()) as http:
        response = await http.get("/v2/models/tiny/getSlotCount")
    # FakeEngine: 32 sequences, 1024 free blocks of 16 tokens.
    assert response.json() == {
        "total_slots": 32,
        "free_slots": 32,
        "available_tokens_length": 1024 * 16,
    }


# ---- /health/timed ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/health/timed", "/health/timed-1", "/health/timed-600"])
async def test_timed_health_runs_a_one_token_generation(path: str) -> None:
    gateway = make_gateway()
    async with client(gateway) as http:
        response = await http.get(path)
    assert (response.status_code, response.json()) == (200, {"status": "healthy"})
    probe = gateway.engine.requests[-1]  # type: ignore[attr-defined]
    assert probe.sampling.max_new_tokens == 1
    assert probe.protocol == "health"


@pytest.mark.parametrize(
    "suffix", ["-0", "-000", "-601", "-1000", "-abc", "--1", "-1.5", "-+5", "-", "-1e2"]
)
async def test_timed_health_rejects_bad_wait_times_with_404(suffix: str) -> None:
    async with client(make_gateway()) as http:
        response = await http.get(f"/health/timed{suffix}")
    assert response.status_code == 404
    assert response.json()["error_type"] == "NotFoundError"


async def test_timed_health_reports_a_failing_engine_as_500() -> None:
    async with client(make_gateway(FakeScript(fail_after=0))) as http:
        response = await http.get("/health/timed-5")
    assert response.status_code == 500
    assert response.json()["error_type"] == "Incomplete Generation"


async def test_timed_health_reports_a_hanging_engine_as_500_after_its_deadline() -> None:
    gateway = make_gateway(FakeScript(hang_after=0))
    async with client(gateway) as http:
        response = await http.get("/health/timed-1")
    assert response.status_code == 500
    assert gateway.lifecycle.inflight == 0  # the probe was aborted and released


async def test_timed_health_is_healthy_while_busy_and_while_stopping() -> None:
    gateway = make_gateway(FakeScript(hang_after=0))
    tasks = await saturate(gateway)
    try:
        async with client(gateway) as http:
            busy = await http.get("/health/timed-2")
            gateway.lifecycle.begin_drain()
            stopping = await http.get("/health/timed-2")
        assert busy.status_code == stopping.status_code == 200
    finally:
        gateway.service.abort_all(ServiceUnavailable("test over"))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_timed_health_is_503_once_the_engine_failed() -> None:
    gateway = make_gateway()
    gateway.lifecycle.fail("dead")
    async with client(gateway) as http:
        assert (await http.get("/health/timed-5")).status_code == 503


# ---- status and config -----------------------------------------------------------------------
async def test_status_v1_and_v2_have_mindie_fields_and_live_counts() -> None:
    gateway = make_gateway(FakeScript(hang_after=1))
    stream = await gateway.service.start(request("running"))
    try:
        async with client(gateway) as http:
            v1 = (await http.get("/v1/status")).json()
            v2 = (await http.get("/v2/status")).json()
    finally:
        await stream.aclose()
    assert v1["service"] == {"roleStatus": "RoleReady", "currentRole": "flex"}
    assert v1["resource"]["runningRequestNum"] == 1
    assert v1["resource"]["availSlotsNum"] == 31
    assert v1["resource"]["totalNpuBlockNums"] == 1024
    assert v1["linkStatus"] == {"peers": []}
    assert v1["gateway"]["state"] == "ready"
    assert v1["gateway"]["inflight"] == 1
    for key in (
        "totalAvailNpuSlotsNum",
        "totalAvailNpuBlockNum",
        "dpInstMap",
        "maxAvailNpuBlockNum",
    ):
        assert key in v2["resource"]
        assert key not in v1["resource"]


@pytest.mark.parametrize("state", [State.DRAINING, State.FAILED])
async def test_status_is_503_once_stopping_or_failed(state: State) -> None:
    gateway = make_gateway()
    if state is State.DRAINING:
        gateway.lifecycle.begin_drain()
    else:
        gateway.lifecycle.fail("dead")
    async with client(gateway) as http:
        assert (await http.get("/v1/status")).status_code == 503
        assert (await http.get("/v2/status")).status_code == 503


async def test_config_has_mindie_fields_and_redacts_secrets() -> None:
    gateway = make_gateway(overrides={"SecurityConfig": {"apiKeys": ["sk-very-secret"]}})
    async with client(gateway) as http:  # with keys set, control routes want one (security.py)
        response = await http.get("/v1/config", headers={"authorization": "Bearer sk-very-secret"})
    body = response.json()
    assert {"modelName", "maxSeqLen", "worldSize", "maxOutputLen", "cacheBlockSize"} <= set(body)
    assert body["modelName"] == "tiny"
    assert body["settings"]["SecurityConfig"]["apiKeys"] == "***"
    assert "sk-very-secret" not in response.text


# ---- role --------------------------------------------------------------------------------------
async def test_role_decode_refuses_new_requests_and_flex_admits_again() -> None:
    gateway = make_gateway()
    async with client(gateway) as http:
        assert (await http.post("/v1/role/decode", json={})).json() == {"result": "ok"}
        assert gateway.lifecycle.role is Role.DECODE
        with pytest.raises(ServiceUnavailable, match="role decode"):
            await gateway.service.generate(request())
        status = (await http.get("/v1/status")).json()
        assert status["service"]["currentRole"] == "decode"
        health = await http.get("/health/timed-2")  # a decode instance still probes its engine
        assert health.status_code == 200
        assert (await http.post("/v1/role/flex")).status_code == 200
    result = await gateway.service.generate(request())
    assert result.usage.completion_tokens == 4


async def test_role_flex_keeps_the_prefill_percentage() -> None:
    gateway = make_gateway()
    async with client(gateway) as http:
        await http.post("/v1/role/flex", json={"local": {"id": 1, "p_percentage": 40}, "peers": []})
        status = (await http.get("/v1/status")).json()
    assert status["service"]["p_percentage"] == 40


@pytest.mark.parametrize(
    ("path", "status"),
    [("/v1/role/leader", 404), ("/v2/role/flex", 404), ("/v1/role/PREFILL", 404)],
)
async def test_unknown_role_is_404_with_the_valid_ones(path: str, status: int) -> None:
    gateway = make_gateway()
    async with client(gateway) as http:
        response = await http.post(path)
    assert response.status_code == status
    assert "use one of" in response.json()["error"]
    assert gateway.lifecycle.role is Role.FLEX


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/role/prefill", b"{not json"),
        ("/v1/role/prefill", b"[1, 2]"),
        ("/v1/role/prefill", b'{"local": []}'),
        ("/v2/role/decode", b'{"local": {}}'),
        ("/v1/role/flex", b'{"local": {"p_percentage": 101}}'),
        ("/v1/role/flex", b'{"local": {"p_percentage": "40"}}'),
        ("/v1/role/decode", b'{"peers": {}}'),
    ],
)
async def test_malformed_role_body_is_422_and_keeps_the_role(path: str, body: bytes) -> None:
    gateway = make_gateway()
    async with client(gateway) as http:
        response = await http.post(path, content=body)
    assert response.status_code == 422
    assert response.json() == {
        "error": "Req body converts to json fail. Reset to previous node status.",
        "error_type": "Input validation error",
    }
    assert gateway.lifecycle.role is Role.FLEX


async def test_role_change_while_draining_is_409() -> None:
    gateway = make_gateway()
    gateway.lifecycle.begin_drain()
    async with client(gateway) as http:
        response = await http.post("/v1/role/prefill")
    assert response.status_code == 409
    assert response.json()["error_type"] == "Conflict"
    assert gateway.lifecycle.role is Role.FLEX


# ---- wrong methods, unknown paths, stopService -------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/stopService"),
        ("DELETE", "/v1/status"),
        ("PUT", "/v1/config"),
        ("GET", "/v1/role/prefill"),
        ("POST", "/health/timed-5"),
        ("POST", "/metrics-json"),
    ],
)
async def test_wrong_method_is_405_in_mindie_envelope(method: str, path: str) -> None:
    async with client(make_gateway()) as http:
        response = await http.request(method, path)
    assert response.status_code == 405
    assert response.json()["error_type"] == "Method Not Allowed"
    assert "allow" in response.headers


async def test_unknown_management_path_is_404_in_mindie_envelope() -> None:
    async with client(make_gateway()) as http:
        response = await http.get("/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error_type"] == "NotFoundError"


async def test_stop_service_rejects_an_unknown_mode_and_keeps_serving() -> None:
    gateway = make_gateway()
    async with client(gateway) as http:
        response = await http.get("/stopService", params={"mode": "Sometime"})
    assert response.status_code == 400
    assert gateway.lifecycle.state is State.READY
    assert not gateway.shutdown.requested.is_set()


async def runtime_drain(gateway: Gateway) -> None:
    """What server/runtime.py does once a stop is requested."""
    await gateway.shutdown.requested.wait()
    await drain(gateway)


async def test_stop_service_waits_for_in_flight_requests_then_answers_200() -> None:
    gateway = make_gateway(FakeScript(token_delay_s=0.01))
    runtime = asyncio.create_task(runtime_drain(gateway))
    work = asyncio.create_task(gateway.service.generate(request("slow", tokens=30)))
    await asyncio.sleep(0.05)
    async with client(gateway) as http:
        stop = await http.get("/stopService")
        again = await http.get("/stopService")  # a second call is harmless
    assert (stop.status_code, stop.content) == (200, b"")
    assert again.status_code == 200
    assert work.done()
    assert (await work).usage.completion_tokens == 30
    await runtime


async def test_force_stop_aborts_in_flight_requests_with_unavailable() -> None:
    gateway = make_gateway(FakeScript(hang_after=1))
    runtime = asyncio.create_task(runtime_drain(gateway))
    work = asyncio.create_task(gateway.service.generate(request("stuck", tokens=30)))
    await asyncio.sleep(0.05)
    async with client(gateway) as http:
        stop = await http.get("/stopService", params={"mode": "Force"})
    assert stop.status_code == 200
    with pytest.raises(ServiceUnavailable, match="shutting down"):
        await work
    await runtime
    assert gateway.lifecycle.inflight == 0


async def test_management_and_data_listeners_see_one_state() -> None:
    gateway = make_gateway()
    async with client(gateway, "data") as data, client(gateway) as management:
        assert (await data.get("/health")).status_code == 200
        gateway.shutdown.request()
        assert (await data.get("/health")).status_code == 503  # TGI's own shape on data
        assert (await management.get("/health")).status_code == 503
        response = await data.get("/health")
    assert response.headers["connection"] == "close"


async def test_while_starting_liveness_is_200_and_everything_else_503() -> None:
    lifecycle = Lifecycle()
    app = StartingApp(lifecycle, starting_answers((MANAGEMENT,)))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        assert (await http.get("/v2/health/live")).status_code == 200
        for path in ("/v2/health/ready", "/health", "/v1/status", "/health/timed-5"):
            response = await http.get(path)
            assert response.status_code == 503, path
            assert response.headers["retry-after"] == "5"
            assert response.json()["error_type"] == "Service Unavailable"


async def test_role_change_leaves_in_flight_requests_running() -> None:
    gateway = make_gateway(FakeScript(token_delay_s=0.005))
    work = asyncio.create_task(gateway.service.generate(request("in-flight", tokens=20)))
    await asyncio.sleep(0.02)
    async with client(gateway) as http:
        assert (await http.post("/v1/role/decode")).status_code == 200
    assert (await work).usage.completion_tokens == 20
