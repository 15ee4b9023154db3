"""vLLM 0.32's beam search on the engine port, as its server runs it
(vllm/entrypoints/generate/beam_search/online.py): per output token, one single-token engine
request with 2 × `n` logprobs for every beam; of all continuations the `n` best by cumulative
logprob go on, one that draws EOS (unless `ignore_eos`) is complete; at the end the `n` best of
the complete and running beams by cumulative logprob / length ** `length_penalty` (the prompt
counted, a final EOS not) are the answer's choices. The answer comes whole, never streamed.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from server.core.engine import Engine, fit_prompt
from server.core.frozen import replaced
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
    TokenLogprob,
    TokenPrompt,
    TopLogprob,
    Usage,
)

Candidates = dict[int, float]  # one step's logprobs of one beam: token id → logprob


@dataclass(frozen=True, slots=True)
class _Beam:
    tokens: tuple[int, ...] = ()  # generated so far
    steps: tuple[Candidates, ...] = ()  # per generated token, the step's candidates
    cum_logprob: float = 0.0
    finish: FinishReason = FinishReason.LENGTH
    stop: int | None = None

    def grown(
        self, token_id: int, step: Candidates, finish: FinishReason = FinishReason.LENGTH,
        stop: int | None = None,
    ) -> _Beam:
        return _Beam((*self.tokens, token_id), (*self.steps, step),
                     self.cum_logprob + step[token_id], finish, stop)

    def aborted(self) -> _Beam:
        return _Beam(self.tokens, self.steps, self.cum_logprob, FinishReason.ABORT)


class BeamSearch:
    """One request's beam search. `events()` is what `Engine.generate` would give for it;
    `abort()` stops it (its running steps end as aborted, and so do its beams)."""

    def __init__(
        self, engine: Engine, request: GenerationRequest, engine_id: str,
        adapter: AdapterHandle | None,
    ) -> None:
        self._engine, self._request, self._adapter = engine, request, adapter
        self._engine_id = engine_id
        self._ids = itertools.count()
        self._running: set[str] = set()
        self._aborted = False
        sampling = request.sampling
        self._width = sampling.n
        self._eos = engine.info().eos_token_id
        # the first step renders, truncates and fits the prompt; later steps send the kept
        # prompt and the beam's tokens whole (a truncation there would slide the window)
        self._step_sampling = Sampling(max_new_tokens=1, temperature=sampling.temperature)
        self._first_sampling = replaced(
            self._step_sampling, truncate_prompt_tokens=sampling.truncate_prompt_tokens,
            budget=sampling.budget,
        )
        self._step_output = OutputOptions(logprobs=2 * self._width)

    async def abort(self) -> None:
        self._aborted = True
        for engine_request_id in list(self._running):
            await self._engine.abort(engine_request_id)

    async def events(self) -> AsyncGenerator[GenerationEvent, None]:
        # the prompt as the request gave it first: the engine renders and fits it once
        first, steps = await self._run([self._request.prompt], self._first_sampling)
        assert first is not None
        prompt = first.prompt_token_ids
        budget = fit_prompt(self._request, self._engine.info(), len(prompt))
        done: list[_Beam] = []
        beams = self._next_beams([_Beam()], steps, done)
        for _ in range(budget.max_tokens - 1):
            if not beams or beams[0].finish is FinishReason.ABORT:
                break
            beams = await self._step(prompt, beams, done)
        best = sorted([*done, *beams], key=lambda b: self._score(len(prompt), b), reverse=True)
        best = best[: self._width]
        yield replaced(first, max_tokens=budget.max_tokens)
        for index, beam in enumerate(best):
            yield await self._choice(index, beam)
        generated = sum(len(beam.tokens) for beam in best)
        yield Done(usage=Usage(prompt_tokens=len(prompt), completion_tokens=generated))

    async def _step(
        self, prompt: tuple[int, ...], beams: list[_Beam], done: list[_Beam]
    ) -> list[_Beam]:
        prompts = [TokenPrompt(prompt + beam.tokens) for beam in beams]
        _, steps = await self._run(prompts, self._step_sampling)
        return self._next_beams(beams, steps, done)

    def _next_beams(
        self, beams: list[_Beam], steps: list[Candidates | None], done: list[_Beam]
    ) -> list[_Beam]:
        """The `n` best continuations; those that drew EOS go to `done`. A step the engine
        aborted ends every beam as aborted."""
        if any(step is None for step in steps):
            return [beam.aborted() for beam in beams]
        grown: list[_Beam] = []
        for beam, step in zip(beams, steps, strict=True):
            assert step is not None
            for token_id in step:
                if token_id == self._eos and not self._request.sampling.ignore_eos:
                    done.append(self._completed(beam, step))
                else:
                    grown.append(beam.grown(token_id, step))
        grown.sort(key=lambda b: b.cum_logprob, reverse=True)
        return grown[: self._width]

    def _completed(self, beam: _Beam, step: Candidates) -> _Beam:
        eos = self._eos
        assert eos is not None
        if self._request.sampling.include_stop_str_in_output:
            return beam.grown(eos, step, finish=FinishReason.STOP, stop=eos)
        return _Beam(beam.tokens, beam.steps, beam.cum_logprob + step[eos],
                     FinishReason.STOP, eos)

    async def _run(
        self, prompts: Sequence[Prompt], sampling: Sampling
    ) -> tuple[Started | None, list[Candidates | None]]:
        """One single-token engine request per prompt, at once: each one's candidates (None
        when aborted), and the first one's `Started`. One failing cancels the others (their
        engine requests are aborted) before the error goes on."""
        runs = [asyncio.ensure_future(self._one(prompt, sampling)) for prompt in prompts]
        try:
            results = await asyncio.gather(*runs)
        except BaseException:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            raise
        return results[0][0], [candidates for _, candidates in results]

    async def _one(
        self, prompt: Prompt, sampling: Sampling
    ) -> tuple[Started | None, Candidates | None]:
        engine_request_id = f"{self._engine_id}-beam-{next(self._ids)}"
        request = replaced(
            self._request, prompt=prompt, sampling=sampling,
            output=self._step_output, stream=False, parse=None,
        )
        started: Started | None = None
        candidates: Candidates | None = None
        self._running.add(engine_request_id)
        try:
            if self._aborted:
                return None, None
            async for event in self._engine.generate(request, engine_request_id, self._adapter):
                if isinstance(event, Started):
                    started = event
                elif isinstance(event, Delta) and event.finish is not FinishReason.ABORT:
                    candidates = _candidates(event.logprobs)
        finally:
            self._running.discard(engine_request_id)
        return started, candidates

    def _score(self, prompt_length: int, beam: _Beam) -> float:
        length = prompt_length + len(beam.tokens)
        if beam.tokens and beam.tokens[-1] == self._eos:
            length -= 1
        penalty = self._request.sampling.length_penalty
        return beam.cum_logprob / float(max(length, 1) ** penalty)

    async def _choice(self, index: int, beam: _Beam) -> Delta:
        sampling = self._request.sampling
        shown = beam.tokens
        if shown and shown[-1] == self._eos and not sampling.ignore_eos:
            shown = shown[:-1]
        text = await self._engine.decode(shown, skip_special_tokens=sampling.skip_special_tokens)
        return Delta(
            choice=index, text=text, token_ids=beam.tokens,
            logprobs=self._logprobs(beam), finish=beam.finish, matched_stop=beam.stop,
        )

    def _logprobs(self, beam: _Beam) -> tuple[TokenLogprob, ...]:
        """Each token's logprob and the step's best others, when the request asked for them."""
        top_n = self._request.output.logprobs
        if top_n is None:
            return ()
        out = []
        for token_id, step in zip(beam.tokens, beam.steps, strict=True):
            ranked = sorted(step.items(), key=lambda item: item[1], reverse=True)
            texts = self._engine.token_texts([t for t, _ in ranked[:top_n]] + [token_id])
            top = tuple(
                TopLogprob(token_id=t, token=text, logprob=lp, rank=rank)
                for rank, ((t, lp), text) in enumerate(zip(ranked[:top_n], texts, strict=False), 1)
            )
            rank = next(r for r, (t, _) in enumerate(ranked, 1) if t == token_id)
            out.append(TokenLogprob(token_id=token_id, token=texts[-1], logprob=step[token_id],
                                    top=top, rank=rank))
        return tuple(out)


def _candidates(logprobs: tuple[TokenLogprob, ...]) -> Candidates:
    """The sampled token and the top alternatives of a single-token output (vLLM's logprobs
    dict: the top 2 × n and the sampled token)."""
    if not logprobs:
        return {}
    sampled = logprobs[0]
    step = {top.token_id: top.logprob for top in sampled.top}
    step.setdefault(sampled.token_id, sampled.logprob)
    return step

