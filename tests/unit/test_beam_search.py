"""Beam search on the engine port as vLLM 0.32's server runs it (server/core/beam_search.py),
against a stub engine whose next-token logprobs are a table: the beams are worked out by hand
below."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import pytest

from server.core.beam_search import BeamSearch
from server.core.errors import EngineError
from server.core.types import (
    Delta,
    Done,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    OutputOptions,
    Sampling,
    Started,
    TokenLogprob,
    TokenPrompt,
    TopLogprob,
)

EOS = 0
PROMPT = (1, 2)
# after the prompt and what follows it: the next token's logprobs (EOS = 0)
TABLE: dict[tuple[int, ...], dict[int, float]] = {
    (1, 2): {5: -0.1, 6: -0.5, EOS: -2.0},
    (1, 2, 5): {7: -0.2, EOS: -0.3},
    (1, 2, 6): {8: -0.05, EOS: -3.0},
    (1, 2, EOS): {9: -1.0},  # only with ignore_eos
    (1, 2, 5, 7): {9: -0.1},
    (1, 2, 6, 8): {9: -0.1},
}


class StubEngine:
    """Answers each single-token request from TABLE; `abort_from` aborts every request of
    that step and later ones."""

    def __init__(self, abort_from: int | None = None) -> None:
        self.requests: list[GenerationRequest] = []
        self.abort_from = abort_from
        self.steps = 0

    def info(self) -> Any:
        class Info:
            eos_token_id = EOS
            max_model_len = 64
            defaults = Sampling()

        return Info()

    async def generate(
        self, request: GenerationRequest, engine_request_id: str, adapter: object
    ) -> AsyncGenerator[GenerationEvent, None]:
        self.requests.append(request)
        assert isinstance(request.prompt, TokenPrompt)
        ids = request.prompt.token_ids
        yield Started(prompt_token_ids=ids, max_tokens=1)
        await asyncio.sleep(0)
        step = len(ids) - len(PROMPT)
        if self.abort_from is not None and step >= self.abort_from:
            yield Delta(choice=0, text="", finish=FinishReason.ABORT)
            return
        table = sorted(TABLE[ids].items(), key=lambda item: -item[1])
        best, logprob = table[0]
        assert request.output.logprobs is not None
        top = tuple(TopLogprob(token_id=t, token=str(t), logprob=lp)
                    for t, lp in table[: request.output.logprobs])
        lp = TokenLogprob(token_id=best, token=str(best), logprob=logprob, top=top)
        yield Delta(choice=0, text=str(best), token_ids=(best,), logprobs=(lp,),
                    finish=FinishReason.LENGTH)

    async def abort(self, engine_request_id: str) -> None:
        pass

    async def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        return " ".join(str(t) for t in token_ids if not (skip_special_tokens and t == EOS))

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return [str(t) for t in token_ids]


def request(**sampling: Any) -> GenerationRequest:
    logprobs = sampling.pop("logprobs", None)
    return GenerationRequest(
        request_id="r", model="", prompt=TokenPrompt(PROMPT),
        sampling=Sampling(**{"n": 2, "max_new_tokens": 2, "beam_search": True, **sampling}),
        output=OutputOptions(logprobs=logprobs),
    )


async def search(engine: StubEngine, req: GenerationRequest) -> list[GenerationEvent]:
    beams = BeamSearch(engine, req, "e", None)  # type: ignore[arg-type]
    return [event async for event in beams.events()]


def choices(events: list[GenerationEvent]) -> list[tuple[tuple[int, ...], str, str, Any]]:
    return [(e.token_ids, e.text, str(e.finish), e.matched_stop)
            for e in events if isinstance(e, Delta)]


@pytest.mark.anyio
async def test_the_best_beams_by_cumulative_logprob_over_length() -> None:
    """Step 1: EOS completes (-2.0); 5 (-0.1) and 6 (-0.5) go on. Step 2: (5, 7) -0.3 and
    (6, 8) -0.55 go on; (5)+EOS -0.4 and (6)+EOS -3.5 complete. Scores over the length with
    the prompt: (5, 7) -0.3/4, (5) -0.4/3, (6, 8) -0.55/4, EOS -2.0/2, (6) -3.5/3."""
    engine = StubEngine()
    events = await search(engine, request())
    assert choices(events) == [((5, 7), "5 7", "length", None), ((5,), "5", "stop", EOS)]
    assert isinstance(events[0], Started) and events[0].max_tokens == 2
    assert isinstance(events[-1], Done)
    assert (events[-1].usage.prompt_tokens, events[-1].usage.completion_tokens) == (2, 3)
    assert [len(r.prompt.token_ids) for r in engine.requests] == [2, 3, 3]  # type: ignore[union-attr]
    assert all(r.output.logprobs == 4 and r.sampling.max_new_tokens == 1
               for r in engine.requests)


@pytest.mark.anyio
async def test_length_penalty_and_stop_string_in_output() -> None:
    longer = await search(StubEngine(), request(length_penalty=2.0))
    assert [c[0] for c in choices(longer)] == [(5, 7), (6, 8)]
    kept = await search(StubEngine(), request(include_stop_str_in_output=True))
    assert choices(kept)[1] == ((5, EOS), "5", "stop", EOS)


@pytest.mark.anyio
async def test_ignore_eos_never_completes_a_beam() -> None:
    events = await search(StubEngine(), request(ignore_eos=True, n=3))
    assert [c[0] for c in choices(events)] == [(5, 7), (5, EOS), (6, 8)]
    assert all(c[2] == "length" for c in choices(events))


@pytest.mark.anyio
async def test_an_aborted_step_ends_the_beams_as_aborted() -> None:
    events = await search(StubEngine(abort_from=1), request(max_new_tokens=3))
    assert choices(events) == [((5,), "5", "abort", None), ((6,), "6", "abort", None)]


@pytest.mark.anyio
async def test_logprobs_of_each_chosen_token_with_the_steps_best() -> None:
    events = await search(StubEngine(), request(logprobs=1))
    best = next(e for e in events if isinstance(e, Delta))
    assert [(lp.token_id, lp.logprob, lp.rank) for lp in best.logprobs] == [(5, -0.1, 1),
                                                                              (7, -0.2, 1)]
    assert [[t.token_id for t in lp.top] for lp in best.logprobs] == [[5], [7]]


@pytest.mark.anyio
async def test_the_routes_take_beam_search_as_vllms_server_does() -> None:
    """Completions and chat serve it whole; streamed completions and a width whose steps would
    ask more logprobs than allowed are vLLM's 400s; streamed chat is served (vLLM streams the
    finished beams)."""
    from tests.unit.gateway_kit import client, make_gateway

    completion = {"model": "tiny", "prompt": "a b", "max_tokens": 3, "use_beam_search": True,
                  "n": 2, "length_penalty": 0.5}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "use_beam_search": True}
    async with client(make_gateway(), "data") as http:
        whole = await http.post("/v1/completions", json=completion)
        streamed = await http.post("/v1/completions", json={**completion, "stream": True})
        wide = await http.post("/v1/completions", json={**completion, "n": 11})
        echoed = await http.post("/v1/completions",
                                 json={**completion, "echo": True, "logprobs": 1})
        chat_whole = await http.post("/v1/chat/completions", json=chat)
        chat_streamed = await http.post("/v1/chat/completions", json={**chat, "stream": True})
    assert whole.status_code == 200 and whole.json()["choices"][0]["text"]
    assert streamed.status_code == 400
    assert streamed.json()["error"]["message"] == (
        "Streaming is not currently supported with beam search")
    assert wide.status_code == 400 and wide.json()["error"]["message"] == (
        "Requested sample logprobs of 22, which is greater than max allowed: 20")
    assert echoed.status_code == 400 and echoed.json()["error"]["param"] == "echo"
    assert chat_whole.status_code == 200
    assert chat_whole.json()["choices"][0]["finish_reason"] == "length"
    assert chat_streamed.status_code == 200 and chat_streamed.text.endswith("data: [DONE]\n\n")


@pytest.mark.anyio
async def test_only_the_first_step_truncates_the_prompt() -> None:
    """Later steps send the kept prompt and the beam's tokens whole, as vLLM's do: truncating
    them again would slide the window off the prompt's start."""
    engine = StubEngine()
    await search(engine, request(truncate_prompt_tokens=2))
    assert [r.sampling.truncate_prompt_tokens for r in engine.requests] == [2, None, None]


class FailingStep(StubEngine):
    """Step 2: one beam's request fails at once, the other's would run until stopped."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped: list[str] = []

    async def generate(
        self, request: GenerationRequest, engine_request_id: str, adapter: object
    ) -> AsyncGenerator[GenerationEvent, None]:
        assert isinstance(request.prompt, TokenPrompt)
        if len(request.prompt.token_ids) == len(PROMPT):
            async for event in super().generate(request, engine_request_id, adapter):
                yield event
            return
        yield Started(prompt_token_ids=request.prompt.token_ids, max_tokens=1)
        if request.prompt.token_ids[-1] == 5:
            raise EngineError("the engine failed while generating this request")
        try:
            await asyncio.Event().wait()
        finally:
            self.stopped.append(engine_request_id)


@pytest.mark.anyio
async def test_a_failing_step_stops_its_other_requests_before_the_error_goes_on() -> None:
    engine = FailingStep()
    with pytest.raises(EngineError):
        await search(engine, request())
    assert engine.stopped == ["e-beam-2"]
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not [t for t in pending if "_one" in repr(t.get_coro())]
