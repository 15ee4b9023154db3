"""The `Engine` port's contract (server/core/engine.py), one suite run against both engines: the
deterministic fake every unit test uses and vLLM on the demo model. What the service relies on:
event order with the finish on each choice's last delta, usage that matches, output in one piece
for requests not streamed, aborts that end promptly, only domain errors escaping, and bad
adapters refused by `add_adapter` without harm."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import pytest

from server.core.errors import AdapterInvalid, ContextLengthExceeded, GatewayError, InvalidRequest
from server.core.types import (
    AdapterHandle,
    Delta,
    Done,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    OutputOptions,
    Prompt,
    Sampling,
    Started,
    TextPrompt,
    TokenPrompt,
)
from server.engines.fake import FakeEngine, FakeScript
from tests.integration.conftest import A1, DEMO, MAX_MODEL_LEN, Harness, generated_ids

CORRUPT = AdapterHandle(name="corrupt", int_id=21, path=str(DEMO / "test-adapters" / "corrupt"))


@pytest.fixture(params=["fake", "vllm"])
def port(request: pytest.FixtureRequest) -> Iterator[Harness]:
    if request.param == "vllm":
        request.applymarker(pytest.mark.engine)
        yield request.getfixturevalue("vllm_harness")
        return
    loop = asyncio.new_event_loop()
    engine = FakeEngine(FakeScript(bad_adapter_paths={CORRUPT.path}), model_name="demo")
    loop.run_until_complete(engine.add_adapter(A1))
    try:
        yield Harness(loop, engine)
    finally:
        loop.close()


PROMPT = TextPrompt("the model is")


def request(prompt: Prompt = PROMPT, *, stream: bool = True,
            output: OutputOptions | None = None, **sampling: Any) -> GenerationRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_new_tokens", 7)
    sampling.setdefault("ignore_eos", True)
    return GenerationRequest(
        request_id="contract", model="demo", prompt=prompt, sampling=Sampling(**sampling),
        output=output or OutputOptions(), stream=stream,
    )


def deltas(events: list[GenerationEvent], choice: int = 0) -> list[Delta]:
    return [e for e in events if isinstance(e, Delta) and e.choice == choice]


def test_started_then_deltas_the_last_carrying_the_finish_then_done(port: Harness) -> None:
    events = port.events(request())
    started, *middle, done = events
    assert isinstance(started, Started) and isinstance(done, Done)
    choice = deltas(events)
    assert choice == middle
    assert [d.finish for d in choice[:-1]] == [None] * (len(choice) - 1)
    assert choice[-1].finish is FinishReason.LENGTH and choice[-1].token_ids
    assert done.usage.prompt_tokens == len(started.prompt_token_ids)
    assert done.usage.completion_tokens == len(generated_ids(events)) == 7


def test_the_steps_that_ran_a_request_are_counted(port: Harness) -> None:
    """Adapters settle by engine steps (server/core/adapter_residency.py)."""
    before = port.engine.steps()
    port.events(request())
    assert port.engine.steps() >= before + 2


def test_each_of_n_choices_ends_exactly_once(port: Harness) -> None:
    events = port.events(request(n=2, temperature=1.0, seed=7, max_new_tokens=5))
    ends = [e for e in events if isinstance(e, Delta) and e.finish is not None]
    assert sorted(e.choice for e in ends) == [0, 1]
    assert len(generated_ids(events, 0)) == len(generated_ids(events, 1)) == 5
    done = events[-1]
    assert isinstance(done, Done) and done.usage.completion_tokens == 10


def test_a_request_not_streamed_gets_each_choice_in_one_delta_with_token_times(
    port: Harness,
) -> None:
    streamed = port.events(request())
    whole = port.events(request(stream=False))
    (one,) = deltas(whole)
    assert one.finish is FinishReason.LENGTH
    assert one.token_ids == tuple(generated_ids(streamed))  # greedy: the same tokens
    assert one.text == "".join(d.text for d in deltas(streamed))
    done = whole[-1]
    assert isinstance(done, Done) and done.timing is not None
    assert done.timing.first_token_s >= 0 and done.timing.decode_s >= 0


def test_a_stop_string_ends_the_choice_before_it(port: Harness) -> None:
    texts = [d.text for d in deltas(port.events(request(max_new_tokens=12))) if d.text.strip()]
    stop = texts[3].strip()
    events = port.events(request(max_new_tokens=12, stop=(stop,)))
    last = deltas(events)[-1]
    assert (last.finish, last.matched_stop) == (FinishReason.STOP, stop)
    assert stop not in "".join(d.text for d in deltas(events))


def test_abort_by_id_ends_the_choice_with_abort_and_done(port: Harness) -> None:
    async def abort_soon() -> list[GenerationEvent]:
        req = request(max_new_tokens=MAX_MODEL_LEN - 8)
        events: list[GenerationEvent] = []
        async with aclosing(port.engine.generate(req, "abort-me", None)) as stream:
            async for event in stream:
                events.append(event)
                if isinstance(event, Delta) and event.token_ids:
                    await port.engine.abort("abort-me")
        return events

    events = port.run(abort_soon())
    assert deltas(events)[-1].finish is FinishReason.ABORT
    assert isinstance(events[-1], Done)
    assert events[-1].usage.completion_tokens < MAX_MODEL_LEN - 8


def test_closing_the_stream_midway_frees_the_engine(port: Harness) -> None:
    async def start_then_close() -> int:
        req = request(max_new_tokens=MAX_MODEL_LEN - 8)
        async with aclosing(port.engine.generate(req, "to-close", None)) as stream:
            async for event in stream:
                if isinstance(event, Delta) and event.token_ids:
                    break
        for _ in range(100):
            if port.engine.stats().running == 0:
                break
            await asyncio.sleep(0.01)
        return port.engine.stats().running

    assert port.run(start_then_close()) == 0
    assert len(port.tokens(request(max_new_tokens=3))) == 3


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ("tokens-fill-the-context", ContextLengthExceeded),
        ("text-too-long", ContextLengthExceeded),
        ("token-out-of-vocabulary", InvalidRequest),
    ],
)
def test_bad_prompts_are_domain_errors_before_any_event(
    port: Harness, bad: str, error: type[GatewayError]
) -> None:
    info = port.engine.info()
    prompt: Prompt = {
        "tokens-fill-the-context": TokenPrompt((5,) * info.max_model_len),
        "text-too-long": TextPrompt("the model is a test " * info.max_model_len),
        "token-out-of-vocabulary": TokenPrompt((1, info.vocab_size + 10**6)),
    }[bad]
    with pytest.raises(error):
        port.events(request(prompt, max_new_tokens=None))
    port.run(port.engine.check_health())


def test_a_bad_adapter_is_refused_by_add_adapter_and_harms_nothing(port: Harness) -> None:
    before = port.tokens(request(), A1)
    with pytest.raises(AdapterInvalid):
        port.run(port.engine.add_adapter(CORRUPT))
    port.run(port.engine.check_health())
    assert port.tokens(request(), A1) == before
    assert CORRUPT.int_id not in port.run(port.engine.resident_adapters())


def test_tokenize_agrees_with_what_generation_saw(port: Harness) -> None:
    started = port.events(request(max_new_tokens=1))[0]
    assert isinstance(started, Started)
    ids = port.run(port.engine.tokenize("the model is", add_special_tokens=True))
    assert tuple(ids) == started.prompt_token_ids
    assert len(port.engine.token_texts(ids)) == len(ids)


def test_logprobs_come_one_per_generated_token(port: Harness) -> None:
    events = port.events(request(output=OutputOptions(logprobs=2), max_new_tokens=4))
    for delta in deltas(events):
        assert [lp.token_id for lp in delta.logprobs] == list(delta.token_ids)


def test_requests_run_concurrently_and_each_gets_its_own_events(port: Harness) -> None:
    async def both() -> list[list[GenerationEvent]]:
        async def one(i: int) -> list[GenerationEvent]:
            req = replace(request(max_new_tokens=4 + i), request_id=f"c{i}")
            async with aclosing(port.engine.generate(req, f"concurrent-{i}", None)) as stream:
                return [event async for event in stream]

        return list(await asyncio.gather(*(one(i) for i in range(3))))

    for i, events in enumerate(port.run(both())):
        assert len(generated_ids(events)) == 4 + i
