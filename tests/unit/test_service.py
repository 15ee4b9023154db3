"""InferenceService policy on the fake engine: admission, resolution, cancel, deadlines, batches."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from server.core.adapter_files import AdapterRules
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.core.errors import (
    DeadlineExceeded,
    EngineError,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    RequestNotFound,
    ServiceUnavailable,
)
from server.core.lifecycle import Lifecycle
from server.core.service import InferenceService, Limits
from server.core.types import (
    Delta,
    Done,
    FinishReason,
    GenerationRequest,
    Sampling,
    Started,
    TextPrompt,
)
from server.engines.fake import FakeEngine, FakeScript
from server.gateway import Gateway, register_startup_adapters
from server.runtime.process import drain
from tests.unit.demo_kit import unit_demo
from tests.unit.gateway_kit import make_gateway

pytestmark = pytest.mark.anyio


def make_service(
    engine: FakeEngine | None = None, limits: Limits | None = None, *, ready: bool = True
) -> InferenceService:
    engine = engine or FakeEngine(model_name="tiny")
    lifecycle = Lifecycle()
    if ready:
        lifecycle.ready()
    registry = AdapterRegistry(
        engine=engine,
        rules=AdapterRules(roots=(str(Path.cwd()),), max_rank=8, base_names=frozenset({"tiny"})),
        limits=AdapterLimits(enabled=True, max_loras=2, max_cpu_loras=4),
    )
    return InferenceService(
        engine=engine,
        adapters=registry,
        lifecycle=lifecycle,
        limits=limits or Limits(),
        base_names=["tiny"],
    )


def request(
    prompt: str = "one two three", *, rid: str = "r", n: int = 1, tokens: int = 4, model: str = ""
) -> GenerationRequest:
    """A streamed request: `start()` returns once its first token is there."""
    return GenerationRequest(
        request_id=rid,
        model=model,
        prompt=TextPrompt(prompt),
        sampling=Sampling(max_new_tokens=tokens, n=n),
        stream=True,
    )


async def test_generate_collects_text_and_usage() -> None:
    result = await make_service().generate(request(tokens=4))
    assert result.choices[0].text == "one two three one "
    assert result.choices[0].finish_reason is FinishReason.LENGTH
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, 4)


async def test_stream_event_order_is_started_deltas_end_done() -> None:
    stream = await make_service().start(request(n=2, tokens=2))
    try:
        events = [event async for event in stream]
    finally:
        await stream.aclose()
    assert isinstance(events[0], Started)
    assert isinstance(events[-1], Done)
    deltas = [e for e in events if isinstance(e, Delta)]
    ends = [e for e in deltas if e.finish is not None]
    assert [e.choice for e in ends] == [0, 1]  # each choice's last delta carries its end
    assert all(e.token_ids for e in ends)
    assert len(deltas) == events[-1].usage.completion_tokens == 4


async def test_a_request_not_streamed_gets_each_choice_in_one_delta() -> None:
    stream = await make_service().start(replace(request(n=2, tokens=3), stream=False))
    try:
        events = [event async for event in stream]
    finally:
        await stream.aclose()
    deltas = [e for e in events if isinstance(e, Delta)]
    assert [(d.choice, len(d.token_ids), d.finish) for d in deltas] == [
        (0, 3, FinishReason.LENGTH),
        (1, 3, FinishReason.LENGTH),
    ]


async def test_unknown_model_raises_model_not_found_and_frees_the_slot() -> None:
    service = make_service()
    with pytest.raises(ModelNotFound, match="does not exist"):
        await service.start(request(model="nope"))
    assert service.admission.running == 0
    assert service.lifecycle.inflight == 0


async def test_not_ready_service_rejects_with_unavailable() -> None:
    with pytest.raises(ServiceUnavailable):
        await make_service(ready=False).start(request())


async def test_queue_full_raises_overloaded() -> None:
    engine = FakeEngine(FakeScript(hang_after=1))
    service = make_service(engine, Limits(max_concurrent=1, max_queue=1, queue_timeout_s=5))
    first = await service.start(request(rid="a"))
    queued = asyncio.create_task(service.start(request(rid="b")))
    await asyncio.sleep(0.01)
    assert service.admission.waiting == 1
    with pytest.raises(Overloaded):
        await service.start(request(rid="c"))
    await first.aclose()
    second = await queued
    await second.aclose()
    assert service.admission.running == 0


async def test_cancel_by_request_id_ends_the_stream_with_abort() -> None:
    engine = FakeEngine(FakeScript(hang_after=1))
    service = make_service(engine)
    stream = await service.start(request(rid="stop-me", tokens=100))
    await service.cancel("stop-me")
    events = [event async for event in stream]
    await stream.aclose()
    assert any(isinstance(e, Delta) and e.finish is FinishReason.ABORT for e in events)
    assert engine.running == 0
    with pytest.raises(RequestNotFound):
        await service.cancel("stop-me")


async def test_closing_a_stream_early_aborts_the_engine_request() -> None:
    engine = FakeEngine(FakeScript(hang_after=1))
    service = make_service(engine)
    stream = await service.start(request(rid="gone", tokens=100))
    await stream.__anext__()
    await stream.aclose()
    assert list(engine.aborted) == [stream.engine_id]
    assert service.lifecycle.inflight == 0


async def test_deadline_ends_a_hanging_request_with_deadline_exceeded() -> None:
    engine = FakeEngine(FakeScript(hang_after=0))
    service = make_service(engine, Limits(request_timeout_s=0.05))
    with pytest.raises(DeadlineExceeded):
        await service.start(request(tokens=10))
    assert service.admission.running == 0


async def test_engine_failure_before_output_raises_from_start() -> None:
    service = make_service(FakeEngine(FakeScript(fail_after=0)))
    with pytest.raises(EngineError):
        await service.start(request())
    assert service.admission.running == 0


async def test_batch_offsets_choices_and_sums_usage() -> None:
    service = make_service()
    result = await service.generate_batch([request("a b", n=2, tokens=2), request("c d", tokens=3)])
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert result.choices[2].text == "c d c "
    assert result.usage.completion_tokens == 7
    assert result.usage.prompt_tokens == 4


@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_batch_whose_client_leaves_while_it_starts_holds_nothing(cancels: int) -> None:
    engine = FakeEngine(FakeScript(hang_after=1))
    service = make_service(engine)
    slow = asyncio.Event()
    resolve = service._resolve

    async def slow_resolve(gen: GenerationRequest) -> object:
        if gen.model == "slow":
            await slow.wait()  # e.g. an adapter waiting for a cached place
        return await resolve(replace(gen, model=""))

    service._resolve = slow_resolve  # type: ignore[method-assign,assignment]
    batch = asyncio.ensure_future(
        service.start_batch([request("a b", rid="b"), request("c d", rid="b", model="slow")])
    )
    await asyncio.sleep(0.05)  # the first prompt starts; the second waits for `slow`
    assert len(engine.requests) == 1
    for _ in range(cancels):  # the client left; a second cancel (a shutdown) hits the clean-up
        batch.cancel()
        await asyncio.sleep(0)
    with pytest.raises(asyncio.CancelledError):
        await batch
    await asyncio.sleep(0.05)
    assert (service.admission.running, service.lifecycle.inflight) == (0, 0)
    assert len(engine.aborted) == 1 and not service.is_active("b")


async def test_a_batch_cancelled_while_it_aborts_a_started_prompt_holds_nothing() -> None:
    engine = FakeEngine(FakeScript(hang_after=0))
    abort = engine.abort

    async def slow_abort(engine_id: str) -> None:  # the real engine's goes over a socket
        await asyncio.sleep(0.05)
        await abort(engine_id)

    engine.abort = slow_abort  # type: ignore[method-assign]
    service = make_service(engine)
    resolve = service._resolve

    async def failing_resolve(gen: GenerationRequest) -> object:
        if gen.model == "bad":
            await asyncio.sleep(0.05)
            raise ModelNotFound("no")
        return await resolve(replace(gen, model=""))

    service._resolve = failing_resolve  # type: ignore[method-assign,assignment]
    batch = asyncio.ensure_future(
        service.start_batch([request("a b", rid="b"), request("c d", rid="b", model="bad")])
    )
    await asyncio.sleep(0.075)  # "bad" failed; the started prompt is being aborted
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    await asyncio.sleep(0.2)
    assert (service.admission.running, service.lifecycle.inflight) == (0, 0)
    assert not service.is_active("b")


async def test_a_batch_of_more_adapters_than_the_engine_can_hold_is_refused_at_once() -> None:
    root = unit_demo()
    engine = FakeEngine(model_name="tiny")
    lifecycle = Lifecycle()
    lifecycle.ready()
    registry = AdapterRegistry(
        engine=engine,
        rules=AdapterRules(roots=(str(root),), max_rank=8, base_names=frozenset({"tiny"})),
        limits=AdapterLimits(enabled=True, max_loras=2, max_cpu_loras=4),
    )
    service = InferenceService(engine=engine, adapters=registry, lifecycle=lifecycle,
                               limits=Limits(), base_names=["tiny"])
    await registry.register("p1", str(root / "adapters" / "a1"), pin=True)
    await registry.register("p2", str(root / "adapters" / "a2"), pin=True)
    for i in (4, 5, 6):
        await registry.register(f"a{i}", str(root / "test-adapters" / f"a{i}"), preload=False)
    with pytest.raises(InvalidRequest, match=r"3 distinct adapters.*2 of them pinned.*at most 2"):
        await service.generate_batch([request(model=f"a{i}") for i in (4, 5, 6)])
    assert (service.admission.running, service.lifecycle.inflight) == (0, 0)
    served = await service.generate_batch(  # a pinned adapter it names takes no other place
        [request(model=name) for name in ("a4", "a5", "p1", "a4", "")]
    )
    assert len(served.choices) == 5


async def test_abort_all_turns_running_streams_into_in_band_errors() -> None:
    service = make_service(FakeEngine(FakeScript(hang_after=1)))
    stream = await service.start(request(tokens=50))
    assert service.abort_all(ServiceUnavailable("shutting down")) == 1
    with pytest.raises(ServiceUnavailable):
        async for _ in stream:
            pass
    await stream.aclose()


# ---- fairness across adapters in the admission queue -------------------------------------------
def sample_of(gateway: Gateway, name: str, **labels: str) -> float | None:
    return gateway.metrics.registry.get_sample_value(name, labels)


async def fair_gateway(*, fair: bool = True, script: FakeScript | None = None) -> Gateway:
    """Adapters a1..a3 on the fake engine, 2 slots, room to queue."""
    demo = unit_demo()
    gateway = make_gateway(
        script or FakeScript(token_delay_s=0.005),
        overrides={
            "LoraConfig": {"adapterDir": str(demo / "adapters"), "adapterRoots": [str(demo)]},
            "LimitsConfig": {"maxConcurrentRequests": 2, "maxQueue": 32, "fairAdmission": fair},
        },
    )
    await register_startup_adapters(gateway)
    return gateway


DEMO_ADAPTERS = ("a1", "a2", "a3")


async def queue_up(service: InferenceService, waiting: int) -> None:
    while service.admission.waiting < waiting:  # noqa: ASYNC110 (no event to wait on)
        await asyncio.sleep(0.001)


@pytest.mark.parametrize(("fair", "cold_finishes"), [(True, {2, 3}), (False, {12})])
async def test_a_cold_adapter_waits_for_one_hot_request_not_the_hot_backlog(
    fair: bool, cold_finishes: set[int]
) -> None:
    """12 requests on a1 hold both slots and queue 10; then one on a2 arrives. Fair: it gets the
    second slot to free up (after one more a1 request); FIFO: it runs after the whole backlog."""
    gateway = await fair_gateway(fair=fair)
    service, finished = gateway.service, []

    async def run(rid: str, model: str) -> None:
        await service.generate(request(rid=rid, model=model, tokens=4))
        finished.append(rid)

    hot = [asyncio.create_task(run(f"hot{i}", "a1")) for i in range(12)]
    await queue_up(service, 10)
    gauge = "gateway_adapter_requests_queued"
    queued = {a: sample_of(gateway, gauge, adapter=a) for a in DEMO_ADAPTERS}
    assert queued == {"a1": 10, "a2": 0, "a3": 0}
    cold = asyncio.create_task(run("cold", "a2"))
    await queue_up(service, 11)
    assert service.admission.queued() == {"a1": 10, "a2": 1}
    await asyncio.gather(*hot, cold)
    assert finished.index("cold") in cold_finishes, finished
    assert (service.admission.running, service.admission.waiting) == (0, 0)


async def test_a_workflow_alias_waits_in_its_adapters_queue_and_the_base_model_in_its_own() -> None:
    gateway = await fair_gateway(script=FakeScript(hang_after=1))
    service = gateway.service
    await service.adapters.add_alias("flow", "a1")
    held = [await service.start(request(rid=f"h{i}", model="a1")) for i in range(2)]
    queued = [
        asyncio.create_task(service.start(request(rid=rid, model=model)))
        for rid, model in (("w", "flow"), ("b", "tiny"), ("b2", ""), ("x", "nope"))
    ]
    await queue_up(service, 4)
    assert service.admission.queued() == {"a1": 1, "": 2, "nope": 1}
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    for stream in held:
        await stream.aclose()
    assert (service.admission.running, service.admission.waiting) == (0, 0)


async def test_drain_finishes_the_queued_requests_of_every_adapter() -> None:
    gateway = await fair_gateway()
    service = gateway.service
    runs = [
        asyncio.create_task(service.generate(request(rid=f"r{i}", model=model, tokens=4)))
        for i, model in enumerate(("a1", "a1", "a1", "a1", "a2", "", "a3"))
    ]
    await queue_up(service, 5)
    gateway.shutdown.request()
    await drain(gateway)
    assert [r.usage.completion_tokens for r in await asyncio.gather(*runs)] == [4] * 7
    assert gateway.shutdown.drained.is_set()
