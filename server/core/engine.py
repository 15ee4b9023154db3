"""The Engine port: the small interface every engine implements (vLLM, fake).

Contract, checked against both engines by tests/contract/:
1. `generate` yields `Started`, then `Delta`s, the last delta of each choice carrying its
   `finish` (never a separate end event, so encoders need no look-ahead), then one `Done`.
   Token counts in `Done.usage` match what was yielded. A request that is not `stream` may get
   each choice's whole output in one delta, with `Done.timing` saying when its tokens came.
2. Only `GatewayError` subclasses escape; engines translate their own exceptions.
3. Closing the iterator (or `abort(engine_request_id)`) ends generation promptly and frees the slot.
4. `generate` never receives an adapter that `add_adapter` has not accepted; `add_adapter` must
   refuse bad adapters with `AdapterInvalid` without harming the engine.
5. `output_parser` gives a fresh parser per answer (and per choice) when the engine has a
   parser configured for what the spec asks; parsers never raise for odd model output.
6. Every prompt is fitted to the context by `fit_prompt` (server/core/budget.py) once it is
   tokenized: the engine keeps the prompt tokens and generates at most the tokens it says, and
   its refusals (in the protocol's words) raise before `Started`.
7. `steps` never goes back, never counts a step the engine did not complete, and advances by at
   least two over a request the engine ran (adapters settle by it).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

from server.core.budget import Budget, fit
from server.core.types import (
    AdapterHandle,
    ChatPrompt,
    EngineInfo,
    EngineStats,
    GenerationEvent,
    GenerationRequest,
    ParsedOutput,
    ParseSpec,
)


class OutputParser(Protocol):
    """Splits one choice's text into reasoning, content and tool calls (vLLM's parsers)."""

    def parse(
        self, text: str, token_ids: Sequence[int], *, prompt_token_ids: Sequence[int] = ()
    ) -> ParsedOutput:
        """A whole answer (`prompt_token_ids`: the prompt it answers, for parsers that look at
        how the prompt ends, e.g. inside an open reasoning block)."""

    def parse_delta(
        self,
        text: str,
        token_ids: Sequence[int],
        *,
        prompt_token_ids: Sequence[int] | None,
        finished: bool,
    ) -> ParsedOutput | None:
        """The next streamed piece (None: nothing to send yet). `prompt_token_ids` comes with
        the first piece; `finished` with the last, so held-back text is flushed."""


class Engine(Protocol):
    def generate(
        self, request: GenerationRequest, engine_request_id: str, adapter: AdapterHandle | None
    ) -> AsyncGenerator[GenerationEvent, None]: ...

    async def abort(self, engine_request_id: str) -> None: ...

    async def check_health(self) -> None:
        """Raise `ServiceUnavailable` if the engine cannot serve."""

    async def add_adapter(
        self, adapter: AdapterHandle, *, evicting: AdapterHandle | None = None
    ) -> None:
        """Load the adapter into the engine (CPU cache), removing `evicting` first (a removal
        that fails is logged, not raised). Raise `AdapterInvalid` if the adapter cannot load."""

    async def remove_adapter(self, adapter: AdapterHandle) -> None: ...

    async def pin_adapter(self, adapter: AdapterHandle) -> None: ...

    async def resident_adapters(self) -> set[int]:
        """Integer ids of the adapters the engine holds now (engine slots or CPU cache)."""

    async def tokenize(self, text: str | ChatPrompt, *, add_special_tokens: bool) -> list[int]: ...

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Text of each token id on its own (for TGI /tokenize and MindIE /v1/tokenizer)."""

    async def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        """The text of a sequence of token ids, as the tokenizer decodes it whole."""

    def output_parser(self, spec: ParseSpec) -> OutputParser | None:
        """A parser for one choice's answer, or None when no configured parser applies (no
        reasoning parser, and no tool-call parser or no `auto_tools`)."""

    def info(self) -> EngineInfo: ...

    def stats(self) -> EngineStats: ...

    def steps(self) -> int:
        """Engine steps completed so far, as this server learnt of them: never goes back, may
        lag behind the engine, never runs ahead of it (0 forever if the engine does not say)."""

    async def shutdown(self) -> None: ...


def fit_prompt(
    request: GenerationRequest,
    info: EngineInfo,
    prompt_tokens: int,
    *,
    engine_default: int | None = None,
) -> Budget:
    """The request's prompt budget (its policy, truncation and limit) on this engine's model.
    `engine_default`: the engine's own limit where neither the request nor the model has one."""
    sampling = request.sampling
    default = info.defaults.max_new_tokens
    return fit(
        prompt_tokens,
        info.max_model_len,
        truncate=sampling.truncate_prompt_tokens,
        max_tokens=sampling.max_new_tokens,
        default_max_tokens=engine_default if default is None else default,
        policy=sampling.budget,
    )
