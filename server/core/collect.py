"""Non-streaming is the fold of the stream: `collect()` turns events into one result."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field

from server.core.errors import EngineError
from server.core.types import (
    Choice,
    Delta,
    FinishReason,
    GenerationEvent,
    GenerationResult,
    Started,
    TokenLogprob,
    Usage,
)


@dataclass
class _ChoiceParts:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: FinishReason = FinishReason.ABORT
    matched_stop: str | int | None = None

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish is not None:
            self.finish = delta.finish
            self.matched_stop = delta.matched_stop

    def to_choice(self, index: int) -> Choice:
        return Choice(
            index=index,
            text="".join(self.text),
            finish_reason=self.finish,
            token_ids=tuple(self.token_ids),
            logprobs=tuple(self.logprobs),
            matched_stop=self.matched_stop,
        )


async def collect(
    events: AsyncIterator[GenerationEvent], *, request_id: str, model: str
) -> GenerationResult:
    """Consume a whole event stream. Raises `EngineError` if it ends without `Done`."""
    folder = _Folder()
    async for event in events:
        folder.add(event)
    return folder.result(request_id=request_id, model=model)


def fold(events: Iterable[GenerationEvent], *, request_id: str, model: str) -> GenerationResult:
    """`collect` of events already received."""
    folder = _Folder()
    for event in events:
        folder.add(event)
    return folder.result(request_id=request_id, model=model)


class _Folder:
    def __init__(self) -> None:
        self._prompts: dict[int, Started] = {}
        self._parts: dict[int, _ChoiceParts] = {}
        self._usage: Usage | None = None

    def add(self, event: GenerationEvent) -> None:
        if isinstance(event, Delta):
            part = self._parts.get(event.choice)
            if part is None:
                part = self._parts[event.choice] = _ChoiceParts()
            part.add(event)
        elif isinstance(event, Started):
            self._prompts.setdefault(event.prompt_index, event)
        else:
            self._usage = event.usage

    def result(self, *, request_id: str, model: str) -> GenerationResult:
        if self._usage is None:
            raise EngineError("generation ended without a result")
        parts = self._parts
        return GenerationResult(
            request_id=request_id,
            model=model,
            prompts=_in_order(self._prompts) or (Started(prompt_token_ids=()),),
            choices=tuple([parts[i].to_choice(i) for i in _order(parts)]),
            usage=self._usage,
        )


def _order(items: Mapping[int, object]) -> Iterable[int]:
    """The keys in order; most answers have one prompt and one choice (nothing to sort)."""
    return items if len(items) < 2 else sorted(items)


def _in_order(items: dict[int, Started]) -> tuple[Started, ...]:
    return tuple(items.values()) if len(items) < 2 else tuple(items[i] for i in sorted(items))
