"""Non-streaming is the fold of the stream: `collect()` turns events into one result."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from server.core.errors import EngineError
from server.core.types import (
    Choice,
    ChoiceEnd,
    Delta,
    Done,
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
    end: ChoiceEnd | None = None

    def to_choice(self, index: int) -> Choice:
        end = self.end or ChoiceEnd(choice=index, reason=FinishReason.ABORT)
        return Choice(
            index=index,
            text="".join(self.text),
            finish_reason=end.reason,
            token_ids=tuple(self.token_ids),
            logprobs=tuple(self.logprobs),
            matched_stop=end.matched_stop,
        )


async def collect(
    events: AsyncIterator[GenerationEvent], *, request_id: str, model: str
) -> GenerationResult:
    """Consume a whole event stream. Raises `EngineError` if it ends without `Done`."""
    started = Started(prompt_token_ids=())
    parts: dict[int, _ChoiceParts] = {}
    usage: Usage | None = None
    async for event in events:
        if isinstance(event, Started):
            started = event
        elif isinstance(event, Delta):
            part = parts.setdefault(event.choice, _ChoiceParts())
            part.text.append(event.text)
            part.token_ids.extend(event.token_ids)
            part.logprobs.extend(event.logprobs)
        elif isinstance(event, ChoiceEnd):
            parts.setdefault(event.choice, _ChoiceParts()).end = event
        elif isinstance(event, Done):
            usage = event.usage
    if usage is None:
        raise EngineError("generation ended without a result")
    choices = tuple(parts[i].to_choice(i) for i in sorted(parts))
    return GenerationResult(
        request_id=request_id, model=model, prompt=started, choices=choices, usage=usage
    )
