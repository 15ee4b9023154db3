"""vLLM's outputs folded into events: what an `error` finish means."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from server.core.errors import EngineError, InvalidRequest
from server.core.types import (
    GenerationRequest,
    Sampling,
    StructuredOutput,
    TextPrompt,
)
from server.engines.vllm_outputs import EventFolder
from server.engines.vllm_prompts import PreparedPrompt


def failed(tokens: tuple[int, ...] = ()) -> Any:
    """A `RequestOutput` whose only completion the engine ended with an error."""
    completion = SimpleNamespace(
        index=0, text="", token_ids=tokens, finish_reason="error", stop_reason=None,
        logprobs=None,
    )
    return SimpleNamespace(prompt_logprobs=None, outputs=[completion], finished=True,
                           metrics=None)


def folder(structured: StructuredOutput | None, **sampling: Any) -> EventFolder:
    request = GenerationRequest(
        request_id="r", model="", prompt=TextPrompt("a"),
        sampling=Sampling(max_new_tokens=4, structured=structured, **sampling),
    )
    return EventFolder(PreparedPrompt(token_ids=[1], text="a"), request, max_tokens=4)


def test_a_structured_request_failed_before_its_first_token_is_a_bad_constraint() -> None:
    with pytest.raises(InvalidRequest, match="could not compile"):
        list(folder(StructuredOutput(regex="(a|b)*" * 5000)).fold(failed()))


@pytest.mark.parametrize(
    ("structured", "tokens"), [(None, ()), (StructuredOutput(regex="[ab]+"), (7,))]
)
def test_other_engine_failures_stay_engine_errors(
    structured: StructuredOutput | None, tokens: tuple[int, ...]
) -> None:
    with pytest.raises(EngineError):
        list(folder(structured).fold(failed(tokens)))


@pytest.mark.parametrize(
    ("restriction", "named"),
    [({"allowed_token_ids": (5,)}, "allowed_token_ids"), ({"bad_words": ("a",)}, "bad_words")],
)
def test_a_grammar_rejected_token_under_token_restrictions_is_the_clients_error(
    restriction: dict[str, Any], named: str
) -> None:
    """vLLM's scheduler ends the request when the grammar rejects the sampled token (the token
    comes with the error): restrictions that leave the constraint no token are a 400, not 500."""
    regex = StructuredOutput(regex="[a-z]{3}")
    with pytest.raises(InvalidRequest, match=f"constraint and {named} left no token"):
        list(folder(regex, **restriction).fold(failed((7,))))
    with pytest.raises(EngineError):  # the same without a constraint is the engine's
        list(folder(None, **restriction).fold(failed((7,))))
    with pytest.raises(EngineError):  # and so is a rejection with no restriction to blame
        list(folder(regex, min_new_tokens=8, ignore_eos=True).fold(failed((7,))))
