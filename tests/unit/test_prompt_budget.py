"""The prompt budget (server/core/budget.py): its rules, the fake engine applying them as the vLLM
engine does (truncation, the model's default, refusals before `Started`), and each protocol's
policy and words as its clients see them, through the in-process gateway on the fake engine (a
512-token context; each word of a prompt is one token). Real-engine proofs: test_vllm_engine.py,
test_tgi_clients.py, test_mindie_http.py, test_openai_sdk.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from protocols.common.budget import VLLM_CUTS, VLLM_REFUSES
from protocols.tgi.translate import TGI_BUDGET
from server.core.budget import REFUSE, BudgetPolicy, fit
from server.core.errors import ContextLengthExceeded, GatewayError, InvalidRequest
from server.core.types import (
    Delta,
    GenerationEvent,
    GenerationRequest,
    Sampling,
    Started,
    TextPrompt,
)
from server.engines.fake import FakeEngine
from tests.unit.gateway_kit import client, make_gateway

CONTEXT = 512


def words(count: int) -> str:
    return " ".join(f"w{i}" for i in range(count))


def decide(
    prompt_tokens: int, policy: BudgetPolicy = REFUSE, *, truncate: int | None = None,
    max_tokens: int | None = None, default: int | None = None,
) -> tuple[int, int]:
    budget = fit(prompt_tokens, CONTEXT, truncate=truncate, max_tokens=max_tokens,
                 default_max_tokens=default, policy=policy)
    return budget.keep, budget.max_tokens


# ---- the rules -----------------------------------------------------------------------------------


def test_without_a_limit_the_models_default_within_the_room_else_all_the_room() -> None:
    assert decide(12) == (12, 500)
    assert decide(12, default=64) == (12, 64)
    assert decide(500, default=64) == (500, 12)  # a default never makes a request too long


def test_truncation_keeps_the_last_tokens_and_minus_one_leaves_room_for_one() -> None:
    assert decide(600, truncate=10) == (10, 502)
    assert decide(600, truncate=-1) == (CONTEXT - 1, 1)
    assert decide(5, truncate=10) == (5, 507)
    with pytest.raises(InvalidRequest) as caught:
        decide(600, truncate=CONTEXT + 1)
    assert caught.value.param == "truncate_prompt_tokens"


def test_an_empty_prompt_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="cannot be empty"):
        decide(0)
    with pytest.raises(InvalidRequest, match="cannot be empty"):
        decide(8, truncate=0)


def test_refuse_and_cut_differ_only_on_a_limit_beyond_the_room() -> None:
    cut = BudgetPolicy(overflow=VLLM_CUTS.overflow)
    assert decide(100, max_tokens=412) == decide(100, cut, max_tokens=412) == (100, 412)
    with pytest.raises(InvalidRequest):
        decide(100, max_tokens=413)
    assert decide(100, cut, max_tokens=CONTEXT) == (100, 412)
    with pytest.raises(InvalidRequest):
        decide(100, cut, max_tokens=CONTEXT + 1)


@pytest.mark.parametrize("policy", [REFUSE, VLLM_CUTS, VLLM_REFUSES])
def test_a_prompt_that_fills_or_passes_the_context_is_a_context_error(
    policy: BudgetPolicy,
) -> None:
    for prompt_tokens in (CONTEXT, CONTEXT + 1):
        with pytest.raises(ContextLengthExceeded):
            decide(prompt_tokens, policy)


def test_counted_compares_only_part_of_the_limit_and_cuts_the_rest() -> None:
    counted = BudgetPolicy(counted=100)
    assert decide(300, counted, max_tokens=5000) == (300, 212)
    with pytest.raises(InvalidRequest):
        decide(450, counted, max_tokens=5000)


# ---- the fake engine applies it ------------------------------------------------------------------


def run(engine: FakeEngine, request: GenerationRequest) -> list[GenerationEvent]:
    async def events() -> list[GenerationEvent]:
        return [event async for event in engine.generate(request, "budget", None)]

    return asyncio.run(events())


def request(prompt: str, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id="r", model="tiny", prompt=TextPrompt(prompt), sampling=Sampling(**sampling)
    )


def test_the_fake_engine_keeps_the_last_words_and_generates_what_the_budget_says() -> None:
    engine = FakeEngine(model_name="tiny")
    events = run(
        engine,
        request(words(600), truncate_prompt_tokens=4, max_new_tokens=CONTEXT, budget=VLLM_CUTS),
    )
    started = events[0]
    assert isinstance(started, Started) and len(started.prompt_token_ids) == 4
    assert started.max_tokens == CONTEXT - 4
    generated = "".join(e.text for e in events if isinstance(e, Delta))
    assert generated.split()[:4] == ["w596", "w597", "w598", "w599"]
    assert len(generated.split()) == CONTEXT - 4


@pytest.mark.parametrize(
    ("sampling", "error", "message"),
    [
        ({"budget": VLLM_REFUSES}, ContextLengthExceeded, "maximum context length is 512"),
        ({"budget": VLLM_CUTS}, ContextLengthExceeded, "maximum context length is 512"),
        ({"budget": TGI_BUDGET}, InvalidRequest, "must be <= 512. Given: 520 `inputs` tokens"),
    ],
)
def test_the_fake_engine_refuses_before_started_in_the_policys_words(
    sampling: dict[str, Any], error: type[GatewayError], message: str
) -> None:
    engine = FakeEngine(model_name="tiny")
    with pytest.raises(error, match=message):
        run(engine, request(words(CONTEXT + 8), **sampling))


# ---- each protocol, as its clients see it --------------------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with client(make_gateway(), "data") as http:
        yield http


async def refused(http: httpx.AsyncClient, path: str, body: dict[str, Any], status: int) -> str:
    response = await http.post(path, json=body)
    assert response.status_code == status, response.text
    return response.text


@pytest.mark.anyio
async def test_openai_cuts_a_limit_to_the_room_and_refuses_one_beyond_the_context(
    http: httpx.AsyncClient,
) -> None:
    body = {"model": "tiny", "prompt": words(100), "max_tokens": 500}
    answer = (await http.post("/v1/completions", json=body)).json()
    assert answer["usage"]["completion_tokens"] == CONTEXT - 100
    assert answer["choices"][0]["finish_reason"] == "length"
    text = await refused(http, "/v1/completions", {**body, "max_tokens": 600}, 400)
    assert "max_tokens=600 cannot be greater than max_model_len=512" in text
    text = await refused(http, "/v1/completions", {**body, "prompt": words(CONTEXT)}, 400)
    assert "max_tokens must be at least 1, got 0." in text


@pytest.mark.anyio
async def test_openai_truncate_prompt_tokens_keeps_the_last_tokens(
    http: httpx.AsyncClient,
) -> None:
    body = {"model": "tiny", "prompt": words(600), "max_tokens": 2, "truncate_prompt_tokens": 7}
    answer = (await http.post("/v1/completions", json=body)).json()
    assert answer["usage"]["prompt_tokens"] == 7


@pytest.mark.anyio
async def test_responses_echo_the_limit_the_budget_set(http: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "input": words(500), "max_output_tokens": 100}
    answer = (await http.post("/v1/responses", json=body)).json()
    assert answer["max_output_tokens"] == answer["usage"]["output_tokens"] < 100


@pytest.mark.anyio
async def test_anthropic_is_refused_in_vllms_words(http: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": words(600)}]}
    text = await refused(http, "/v1/messages", body, 400)
    assert "This model's maximum context length is 512 tokens" in text


@pytest.mark.anyio
async def test_tgi_counts_one_round_and_truncates(http: httpx.AsyncClient) -> None:
    body = {"inputs": "a b c", "parameters": {"max_new_tokens": 510}}
    text = await refused(http, "/generate", body, 422)
    assert (
        "`inputs` tokens + `max_new_tokens` must be <= 512. Given: 3 `inputs` tokens and 510 "
        "`max_new_tokens`"
    ) in text
    body = {"inputs": words(CONTEXT), "parameters": {}}
    assert "`inputs` must have less than 511 tokens. Given: 512" in await refused(
        http, "/generate", body, 422
    )
    body = {"inputs": words(600), "parameters": {"truncate": 3, "max_new_tokens": 3}}
    answer = (await http.post("/generate", json=body)).json()
    assert answer["generated_text"].split() == ["w597", "w598", "w599"]


@pytest.mark.anyio
async def test_mindie_refuses_a_limit_beyond_the_room(http: httpx.AsyncClient) -> None:
    body = {"inputs": words(100), "parameters": {"max_new_tokens": 600}}
    text = await refused(http, "/infer", body, 422)
    assert "'max_tokens' or 'max_completion_tokens' is too large: 600" in text


@pytest.mark.anyio
async def test_djl_refuses_a_prompt_that_fills_the_context(http: httpx.AsyncClient) -> None:
    body = {"inputs": words(CONTEXT), "parameters": {"max_new_tokens": 4}}
    text = await refused(http, "/invocations", body, 424)  # LMI's status for a handler error
    assert "which leaves no room for any output tokens" in text


@pytest.mark.anyio
async def test_kserve_refuses_a_limit_beyond_the_room(http: httpx.AsyncClient) -> None:
    body = {"text_input": words(100), "parameters": {"max_tokens": 600}}
    text = await refused(http, "/v2/models/tiny/generate", body, 400)
    assert "'max_tokens' or 'max_completion_tokens' is too large: 600" in text
