"""The prompt budget: how one request's prompt and output share the model's context.

Every engine asks `fit` once per request, with its prompt's token count: which prompt tokens are
kept (truncation keeps the last ones), and how many tokens may be generated (the request's limit,
else the model's default, within the room the prompt leaves), or the refusal. The rules are here;
a protocol chooses only its `BudgetPolicy` (carried by `Sampling.budget`): whether a limit the
prompt leaves no room for is refused or cut, how much of it counts, and its words for each refusal.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from server.core.errors import ContextLengthExceeded, GatewayError, InvalidRequest
from server.core.frozen import quick_init


class Overflow(Enum):
    """What happens to an output limit larger than the room the prompt leaves."""

    REFUSE = "refuse"  # refused
    CUT = "cut"  # cut to the room; only a limit beyond the whole context is refused


@quick_init
@dataclass(frozen=True, slots=True)
class Ask:
    """What a refusal is about: the prompt's tokens (after truncation), the context length and
    the output limit as the policy counted it (the model's default when the request has none)."""

    prompt_tokens: int
    context: int
    new_tokens: int


class BudgetWords:
    """A protocol's words for the budget's refusals (these are the core's own, plain ones)."""

    def truncation_too_large(self, limit: int, context: int) -> GatewayError:
        return InvalidRequest(
            f"Cannot keep the last {limit} prompt tokens: the context holds {context}.",
            param="truncate_prompt_tokens",
        )

    def prompt_too_long(self, ask: Ask) -> GatewayError:
        return ContextLengthExceeded(
            f"The prompt has {ask.prompt_tokens} tokens; the model's context holds "
            f"{ask.context}.",
            param="prompt",
        )

    def no_room(self, ask: Ask) -> GatewayError:
        return ContextLengthExceeded(
            f"The prompt has {ask.prompt_tokens} tokens and fills the model's context: no room "
            "is left for output tokens.",
            param="prompt",
        )

    def too_many_new_tokens(self, ask: Ask) -> GatewayError:
        return InvalidRequest(
            f"{ask.new_tokens} output tokens do not fit: the context holds {ask.context} and "
            f"the prompt has {ask.prompt_tokens}.",
            param="max_tokens",
        )


CORE_WORDS = BudgetWords()


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetPolicy:
    """A protocol's choices. `counted`: REFUSE compares at most this many of the limit with the
    room (the rest is cut to the room), as TGI's router counts one generation round."""

    overflow: Overflow = Overflow.REFUSE
    counted: int | None = None
    words: BudgetWords = CORE_WORDS


REFUSE = BudgetPolicy()


@quick_init
@dataclass(frozen=True, slots=True)
class Budget:
    """The decision: keep the last `keep` prompt tokens; generate at most `max_tokens`."""

    keep: int
    max_tokens: int


def fit(
    prompt_tokens: int,
    context: int,
    *,
    truncate: int | None,
    max_tokens: int | None,
    default_max_tokens: int | None,
    policy: BudgetPolicy,
) -> Budget:
    """Decide, or raise the policy's refusal. `truncate`: keep at most that many of the last
    prompt tokens (-1: as many as leave room for one output token); `max_tokens`: the request's
    limit (None: the model's `default_max_tokens`, else all the room)."""
    keep = _kept(prompt_tokens, context, truncate, policy.words)
    if keep == 0:
        raise InvalidRequest("The prompt cannot be empty.", param="prompt")
    room = max(context - keep, 0)
    wanted = max_tokens
    if wanted is None:
        wanted = room if default_max_tokens is None else min(room, default_max_tokens)
    counted = wanted if policy.counted is None else min(wanted, policy.counted)
    ask = Ask(keep, context, counted)
    if keep > context:
        raise policy.words.prompt_too_long(ask)
    if keep == context:
        raise policy.words.no_room(ask)
    beyond = context if policy.overflow is Overflow.CUT else room
    if max_tokens is not None and counted > beyond:
        raise policy.words.too_many_new_tokens(ask)
    return Budget(keep=keep, max_tokens=min(wanted, room))


def _kept(prompt_tokens: int, context: int, truncate: int | None, words: BudgetWords) -> int:
    """How many prompt tokens stay (truncation keeps the last ones, as vLLM's)."""
    if truncate is None:
        return prompt_tokens
    if truncate > context:
        raise words.truncation_too_large(truncate, context)
    limit = context - 1 if truncate < 0 else truncate
    return min(limit, prompt_tokens)
