"""`VllmEngine` against the real vLLM engine on the tiny demo model (one engine per module)."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Coroutine, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any, TypeVar

import pytest

from server.core.engine import Engine
from server.core.errors import (
    AdapterInvalid,
    ContextLengthExceeded,
    InvalidRequest,
    Unsupported,
)
from server.core.types import (
    AdapterHandle,
    ChatMessage,
    ChatPrompt,
    ChoiceEnd,
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
from server.demo_model import build_demo
from server.engine.vllm_engine import VllmEngine, VllmEngineOptions, create

pytestmark = pytest.mark.engine

T = TypeVar("T")

DEMO = Path(__file__).resolve().parents[2] / "build" / "demo"
MAX_MODEL_LEN = 128
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
A1 = AdapterHandle(name="a1", int_id=1, path=str(DEMO / "adapters" / "a1"))
A2 = AdapterHandle(name="a2", int_id=2, path=str(DEMO / "adapters" / "a2"))
A3 = AdapterHandle(name="a3", int_id=3, path=str(DEMO / "adapters" / "a3"))
PROMPT = TextPrompt("the model is")
_ids = itertools.count()


class Harness:
    """The module's engine plus the one event loop it lives on."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: VllmEngine) -> None:
        self.loop = loop
        self.engine = engine

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def events(
        self, request: GenerationRequest, adapter: AdapterHandle | None = None
    ) -> list[GenerationEvent]:
        return self.run(collect(self.engine, request, adapter))

    def tokens(self, request: GenerationRequest, adapter: AdapterHandle | None = None) -> list[int]:
        return generated_ids(self.events(request, adapter))


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    build_demo(DEMO)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ENGINE_ENV.items():
            patch.setenv(name, os.environ.get(name, value))
        loop = asyncio.new_event_loop()
        engine = loop.run_until_complete(create(engine_options()))
        try:
            loop.run_until_complete(engine.add_adapter(A1))
            loop.run_until_complete(engine.add_adapter(A2))
            yield Harness(loop, engine)
        finally:
            loop.run_until_complete(engine.shutdown())
            loop.close()


def engine_options() -> VllmEngineOptions:
    return VllmEngineOptions(
        model_path=str(DEMO / "model"),
        served_model_name="demo",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=4,
    )


def request(
    prompt: Prompt = PROMPT, output: OutputOptions | None = None, **sampling: Any
) -> GenerationRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_new_tokens", 12)
    sampling.setdefault("ignore_eos", True)
    return GenerationRequest(
        request_id="test",
        model="demo",
        prompt=prompt,
        sampling=Sampling(**sampling),
        output=output or OutputOptions(),
    )


async def collect(
    engine: VllmEngine, req: GenerationRequest, adapter: AdapterHandle | None = None
) -> list[GenerationEvent]:
    async with aclosing(engine.generate(req, f"engine-{next(_ids)}", adapter)) as stream:
        return [event async for event in stream]


def generated_ids(events: list[GenerationEvent], choice: int = 0) -> list[int]:
    return [t for e in events if isinstance(e, Delta) and e.choice == choice for t in e.token_ids]


def generated_text(events: list[GenerationEvent], choice: int = 0) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta) and e.choice == choice)


def test_greedy_generation_is_deterministic(harness: Harness) -> None:
    first = harness.tokens(request())
    assert len(first) == 12
    assert harness.tokens(request()) == first


def test_each_adapter_changes_the_output(harness: Harness) -> None:
    base = harness.tokens(request())
    with_a1 = harness.tokens(request(), A1)
    with_a2 = harness.tokens(request(), A2)
    assert len({tuple(base), tuple(with_a1), tuple(with_a2)}) == 3
    assert harness.tokens(request(), A1) == with_a1


def test_stream_is_started_deltas_one_choice_end_then_done(harness: Harness) -> None:
    events = harness.events(request(max_new_tokens=7))
    started, *middle, end, done = events
    assert isinstance(started, Started)
    assert started.prompt_text == "the model is"
    assert all(isinstance(e, Delta) for e in middle)
    assert end == ChoiceEnd(choice=0, reason=FinishReason.LENGTH)
    assert isinstance(done, Done)
    assert done.usage.prompt_tokens == len(started.prompt_token_ids)
    assert done.usage.completion_tokens == len(generated_ids(events)) == 7


def test_chat_prompt_is_rendered_with_the_template(harness: Harness) -> None:
    chat = ChatPrompt(messages=(ChatMessage("user", "hi there"),))
    started = harness.events(request(chat, max_new_tokens=2))[0]
    assert isinstance(started, Started)
    assert started.prompt_text == "<s><|user|>hi there</s><|assistant|>"
    ids = harness.run(harness.engine.tokenize(chat, add_special_tokens=False))
    assert tuple(ids) == started.prompt_token_ids


def test_two_choices_each_end_once_and_usage_sums_them(harness: Harness) -> None:
    events = harness.events(request(n=2, temperature=1.0, seed=7, max_new_tokens=5))
    ends = [e for e in events if isinstance(e, ChoiceEnd)]
    assert sorted(e.choice for e in ends) == [0, 1]
    assert len(generated_ids(events, 0)) == len(generated_ids(events, 1)) == 5
    done = events[-1]
    assert isinstance(done, Done)
    assert done.usage.completion_tokens == 10


def test_stop_string_ends_the_choice_before_it(harness: Harness) -> None:
    full = harness.events(request(max_new_tokens=12))
    texts = [e.text for e in full if isinstance(e, Delta) and e.text.strip()]
    stop = texts[3].strip()
    events = harness.events(request(max_new_tokens=12, stop=(stop,)))
    end = next(e for e in events if isinstance(e, ChoiceEnd))
    assert end.reason is FinishReason.STOP
    assert end.matched_stop == stop
    text = generated_text(events)
    assert stop not in text
    assert generated_text(full).startswith(text)


def test_logprobs_carry_the_sampled_token_and_top_n_by_rank(harness: Harness) -> None:
    events = harness.events(request(output=OutputOptions(logprobs=3), max_new_tokens=4))
    deltas = [e for e in events if isinstance(e, Delta)]
    assert deltas
    for delta in deltas:
        assert [lp.token_id for lp in delta.logprobs] == list(delta.token_ids)
        for lp in delta.logprobs:
            assert len(lp.top) == 3
            assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
            assert lp.top[0].token_id == lp.token_id  # greedy picks the best
            assert lp.logprob == lp.top[0].logprob <= 0.0


def test_prompt_logprobs_are_refused_while_lora_is_enabled(harness: Harness) -> None:
    with pytest.raises(Unsupported):
        harness.events(request(output=OutputOptions(prompt_logprobs=1)))
    harness.run(harness.engine.check_health())


def test_prompt_filling_the_context_is_context_length_exceeded(harness: Harness) -> None:
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 128 tokens"):
        harness.events(request(TokenPrompt((5,) * MAX_MODEL_LEN), max_new_tokens=None))


def test_long_text_prompt_is_context_length_exceeded(harness: Harness) -> None:
    with pytest.raises(ContextLengthExceeded, match="However, your prompt contains"):
        harness.events(request(TextPrompt("the model is a test " * 200)))


def test_vllm_validation_error_is_invalid_request_before_any_event(harness: Harness) -> None:
    async def first_event() -> GenerationEvent:
        req = request(output=OutputOptions(logprobs=50))
        async with aclosing(harness.engine.generate(req, "too-many-logprobs", None)) as stream:
            return await anext(stream)

    with pytest.raises(InvalidRequest, match="logprobs"):
        harness.run(first_event())
    harness.run(harness.engine.check_health())


def test_max_new_tokens_beyond_the_context_is_invalid(harness: Harness) -> None:
    with pytest.raises(
        InvalidRequest, match="'max_tokens' or 'max_completion_tokens' is too large"
    ):
        harness.events(request(TokenPrompt((5,) * 100), max_new_tokens=29))
    events = harness.events(request(TokenPrompt((5,) * 100), max_new_tokens=None))
    assert len(generated_ids(events)) == MAX_MODEL_LEN - 100


def test_out_of_vocabulary_token_id_is_invalid(harness: Harness) -> None:
    vocab = harness.engine.info().vocab_size
    with pytest.raises(InvalidRequest, match="out of vocabulary"):
        harness.events(request(TokenPrompt((1, vocab + 5))))


@pytest.mark.parametrize(
    ("name", "path", "message"),
    [
        ("big16", "test-adapters/big16", "LoRA rank 16 is greater than max_lora_rank 8."),
        ("corrupt", "test-adapters/corrupt", "header"),
        ("noconfig", "test-adapters/noconfig", "No adapter found"),
        ("missing", "test-adapters/does-not-exist", "No adapter found"),
    ],
)
def test_bad_adapter_is_refused_and_the_engine_keeps_serving(
    harness: Harness, name: str, path: str, message: str
) -> None:
    before_base, before_a1 = harness.tokens(request()), harness.tokens(request(), A1)
    bad = AdapterHandle(name=name, int_id=20, path=str(DEMO / path))
    with pytest.raises(AdapterInvalid, match=message) as refused:
        harness.run(harness.engine.add_adapter(bad))
    assert "stack trace" not in refused.value.message
    harness.run(harness.engine.check_health())
    assert harness.tokens(request()) == before_base
    assert harness.tokens(request(), A1) == before_a1


def test_closing_the_stream_midway_aborts_and_frees_the_slot(harness: Harness) -> None:
    async def start_then_close() -> int:
        req = request(max_new_tokens=MAX_MODEL_LEN - 8)
        async with aclosing(harness.engine.generate(req, "to-abort", None)) as stream:
            async for event in stream:
                if isinstance(event, Delta) and event.token_ids:
                    break
        for _ in range(100):
            if harness.engine.stats().running == 0:
                break
            await asyncio.sleep(0.01)
        return harness.engine.stats().running

    assert harness.run(start_then_close()) == 0
    stats = harness.engine.stats()
    assert stats.waiting == 0
    assert stats.free_blocks == stats.total_blocks > 0
    assert len(harness.tokens(request(max_new_tokens=3))) == 3


def test_cancelling_the_consumer_task_aborts_the_request(harness: Harness) -> None:
    first_delta = asyncio.Event()

    async def consume() -> None:
        req = request(max_new_tokens=MAX_MODEL_LEN - 8)
        async with aclosing(harness.engine.generate(req, "to-cancel", None)) as stream:
            async for event in stream:
                if isinstance(event, Delta):
                    first_delta.set()

    async def cancel_midway() -> int:
        task = asyncio.create_task(consume())
        await first_delta.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return harness.engine.stats().running

    assert harness.run(cancel_midway()) == 0
    assert len(harness.tokens(request(max_new_tokens=3))) == 3


def test_abort_by_id_ends_the_stream_with_abort(harness: Harness) -> None:
    async def abort_soon() -> list[GenerationEvent]:
        req = request(max_new_tokens=MAX_MODEL_LEN - 8)
        events: list[GenerationEvent] = []
        async with aclosing(harness.engine.generate(req, "abort-me", None)) as stream:
            async for event in stream:
                events.append(event)
                if isinstance(event, Delta):
                    await harness.engine.abort("abort-me")
        return events

    events = harness.run(abort_soon())
    assert ChoiceEnd(choice=0, reason=FinishReason.ABORT) in events
    assert isinstance(events[-1], Done)
    assert events[-1].usage.completion_tokens < MAX_MODEL_LEN - 8


def test_pinned_then_removed_adapter_is_no_longer_resident(harness: Harness) -> None:
    harness.run(harness.engine.add_adapter(A3))
    harness.run(harness.engine.pin_adapter(A3))
    assert A3.int_id in harness.run(harness.engine.resident_adapters())
    assert len(harness.tokens(request(), A3)) == 12
    harness.run(harness.engine.remove_adapter(A3))
    assert A3.int_id not in harness.run(harness.engine.resident_adapters())


def test_info_and_vllm_prometheus_metrics(harness: Harness) -> None:
    from prometheus_client import generate_latest

    port: Engine = harness.engine  # mypy checks that VllmEngine satisfies the port
    info = port.info()
    assert (info.max_model_len, info.max_lora_rank, info.max_loras) == (MAX_MODEL_LEN, 8, 2)
    assert info.dtype == "float32"
    assert info.version.startswith("0.32")
    assert b"vllm:num_requests_running" in generate_latest()
