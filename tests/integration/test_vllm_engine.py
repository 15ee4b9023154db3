"""`VllmEngine` on the tiny demo model: what is vLLM's own (determinism, adapters, the chat
template, logprob ranks, vLLM's validation, the CPU LoRA hazards). What every engine must do is
in test_engine_contract.py, run against this engine too."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any

import pytest

from protocols.common.budget import VLLM_CUTS, VLLM_REFUSES
from server.core.engine import Engine
from server.core.errors import AdapterInvalid, InvalidRequest, Unsupported
from server.core.types import (
    AdapterHandle,
    ChatMessage,
    ChatPrompt,
    Delta,
    GenerationEvent,
    GenerationRequest,
    OutputOptions,
    Prompt,
    Sampling,
    Started,
    TextPrompt,
    TokenPrompt,
)
from tests.integration.conftest import A1, A2, A3, DEMO, MAX_MODEL_LEN, Harness, generated_ids

pytestmark = pytest.mark.engine
PROMPT = TextPrompt("the model is")


@pytest.fixture
def harness(vllm_harness: Harness) -> Harness:
    return vllm_harness


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
        stream=True,
    )


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


def test_chat_prompt_is_rendered_with_the_template(harness: Harness) -> None:
    chat = ChatPrompt(messages=(ChatMessage("user", "hi there"),))
    started = harness.events(request(chat, max_new_tokens=2))[0]
    assert isinstance(started, Started)
    assert started.prompt_text == "<s><|user|>hi there</s><|assistant|>"
    ids = harness.run(harness.engine.tokenize(chat, add_special_tokens=False))
    assert tuple(ids) == started.prompt_token_ids


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


def test_vllm_validation_error_is_invalid_request_before_any_event(harness: Harness) -> None:
    async def first_event() -> GenerationEvent:
        req = request(output=OutputOptions(logprobs=50))
        async with aclosing(harness.engine.generate(req, "too-many-logprobs", None)) as stream:
            return await anext(stream)

    with pytest.raises(InvalidRequest, match="logprobs"):
        harness.run(first_event())
    harness.run(harness.engine.check_health())


def test_max_new_tokens_is_cut_to_the_room_the_prompt_leaves(harness: Harness) -> None:
    """vLLM 0.32's OpenAI server cuts; only a limit beyond the whole context is refused."""
    with pytest.raises(InvalidRequest, match="cannot be greater than max_model_len"):
        harness.events(
            request(TokenPrompt((5,) * 10), max_new_tokens=MAX_MODEL_LEN + 1, budget=VLLM_CUTS)
        )
    events = harness.events(
        request(TokenPrompt((5,) * 100), max_new_tokens=29, ignore_eos=True, budget=VLLM_CUTS)
    )
    assert len(generated_ids(events)) == MAX_MODEL_LEN - 100


def test_a_limit_the_prompt_leaves_no_room_for_is_refused_unless_cut(harness: Harness) -> None:
    """The other protocols' servers refuse what vLLM's OpenAI server would cut."""
    with pytest.raises(InvalidRequest, match="maximum context length is 128 tokens"):
        harness.events(request(TokenPrompt((5,) * 100), max_new_tokens=29, budget=VLLM_REFUSES))
    with pytest.raises(InvalidRequest, match="leaves no room for any output tokens"):
        harness.events(request(TokenPrompt((5,) * MAX_MODEL_LEN), budget=VLLM_REFUSES))


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
