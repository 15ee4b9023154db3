"""Chat prompts as vLLM builds them, for every protocol with a chat form: the template variables a
request may set, and the model name an answer shows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from server.core.errors import InvalidRequest

# chat_template_kwargs that would change how the template is called rather than what it
# renders (CVE-2025-62426: `chat_template` swaps the template, `tokenize` the output type).
RESERVED_TEMPLATE_KEYS = frozenset(
    {
        "tokenize",
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
        "tokenizer_kwargs",
        "return_dict",
        "return_assistant_tokens_mask",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
    }
)
MAX_TEMPLATE_KWARGS = 64
MAX_TEMPLATE_VALUE_CHARS = 4096


def template_kwargs(
    raw: Mapping[str, Any] | None,
) -> tuple[tuple[str, str | int | float | bool | None], ...]:
    """Only flat scalar template variables pass (CVE-2025-62426)."""
    if not raw:
        return ()
    if len(raw) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequest(
            f"At most {MAX_TEMPLATE_KWARGS} chat_template_kwargs are allowed.",
            param="chat_template_kwargs",
        )
    checked: list[tuple[str, str | int | float | bool | None]] = []
    for key, value in raw.items():
        if key in RESERVED_TEMPLATE_KEYS or not key.isidentifier():
            raise InvalidRequest(
                f"chat_template_kwargs may not set '{key}'.", param=f"chat_template_kwargs.{key}"
            )
        if not isinstance(value, str | int | float | bool | None) or (
            isinstance(value, str) and len(value) > MAX_TEMPLATE_VALUE_CHARS
        ):
            raise InvalidRequest(
                f"chat_template_kwargs['{key}'] must be a string (at most "
                f"{MAX_TEMPLATE_VALUE_CHARS} characters), number, boolean or null.",
                param=f"chat_template_kwargs.{key}",
            )
        checked.append((key, value))
    return tuple(checked)


def with_effort(
    kwargs: tuple[tuple[str, Any], ...], effort: str | None
) -> tuple[tuple[str, Any], ...]:
    """vLLM hands `reasoning_effort` to the template (over the same template variable), and
    `enable_thinking` unless the request's template variables set it."""
    if effort is None:
        return kwargs
    given = dict(kwargs)
    given["reasoning_effort"] = effort
    given.setdefault("enable_thinking", effort != "none")
    return tuple(given.items())


def response_model(requested: str | None, base_names: Iterable[str], served_name: str) -> str:
    """The adapter name for LoRA requests, else the served base name (vLLM's `model_name()`)."""
    if not requested or requested in base_names:
        return served_name
    return requested
