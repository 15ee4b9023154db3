"""Prompt preparation: text, chat and token prompts all become token ids here (the chat template
rendered with the model's tokenizer), and reach vLLM pre-tokenized (no second tokenization
inside vLLM)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from server.core.errors import InvalidRequest
from server.core.types import ChatMessage, ChatPrompt, Prompt, TokenPrompt
from server.engines.vllm_errors import first_line

if TYPE_CHECKING:
    from vllm.inputs import TokensInput
    from vllm.tokenizers import TokenizerLike

_T = TypeVar("_T")

# Prompts longer than this (characters, or token ids to decode) are processed in a worker
# thread so that one huge prompt does not stall every other stream on the event loop.
_OFF_LOOP_SIZE = 2000


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    token_ids: list[int]
    text: str | None


class PromptRenderer:
    """The model's tokenizer applied to prompts: chat templates, encoding, decoding."""

    def __init__(self, tokenizer: TokenizerLike, vocab_end: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_end = vocab_end

    async def render(self, prompt: Prompt) -> PreparedPrompt:
        if isinstance(prompt, TokenPrompt):
            token_ids = list(prompt.token_ids)
            self._check_token_ids(token_ids)
            return PreparedPrompt(token_ids, None)
        if isinstance(prompt, ChatPrompt):
            text = await _off_loop(_chat_size(prompt), self._render_chat, prompt)
            add_special_tokens = False  # the chat template already placed them
        else:
            text, add_special_tokens = prompt.text, prompt.add_special_tokens
        token_ids = await _off_loop(len(text), self._encode, text, add_special_tokens)
        return PreparedPrompt(token_ids, text)

    async def with_text(self, prompt: PreparedPrompt) -> PreparedPrompt:
        """The prompt with its text (decoded when it came as token ids or was cut)."""
        if prompt.text is not None:
            return prompt
        text = await _off_loop(len(prompt.token_ids), self._decode, prompt.token_ids)
        return PreparedPrompt(prompt.token_ids, text)

    async def tokenize(self, text: str | ChatPrompt, *, add_special_tokens: bool) -> list[int]:
        if isinstance(text, ChatPrompt):
            text = await _off_loop(_chat_size(text), self._render_chat, text)
        return await _off_loop(len(text), self._encode, text, add_special_tokens)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return [self._tokenizer.decode([token_id]) for token_id in token_ids]

    async def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        decode = partial(self._tokenizer.decode, skip_special_tokens=skip_special_tokens)
        return await _off_loop(len(token_ids), decode, list(token_ids))

    def _render_chat(self, prompt: ChatPrompt) -> str:
        messages: list[Any] = [_chat_message(m) for m in prompt.messages]
        kwargs: dict[str, Any] = dict(prompt.chat_template_kwargs)
        if prompt.tools:
            kwargs["tools"] = json.loads(prompt.tools)
        kwargs.update(
            tokenize=False,
            add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message,
        )
        try:
            rendered = self._tokenizer.apply_chat_template(messages, **kwargs)
        except Exception as exc:  # template code can raise anything; the request caused it
            raise InvalidRequest(f"the chat template failed: {first_line(exc)}") from exc
        if not isinstance(rendered, str):
            raise InvalidRequest("the chat template did not render text")
        return rendered

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def _check_token_ids(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self._vocab_end:
                raise InvalidRequest(
                    f"Token id {token_id} is out of vocabulary (valid ids are 0 to "
                    f"{self._vocab_end - 1}).",
                    param="prompt",
                )


def engine_input(prompt: PreparedPrompt) -> TokensInput:
    from vllm.inputs import tokens_input

    return tokens_input(prompt.token_ids, prompt=prompt.text)


def _chat_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (vLLM's shape: tool-call arguments as objects)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    return out


def _arguments(text: str) -> object:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def _chat_size(prompt: ChatPrompt) -> int:
    return sum(len(message.content) for message in prompt.messages) + len(prompt.tools or "")


async def _off_loop(size: int, func: Callable[..., _T], *args: Any) -> _T:
    if size > _OFF_LOOP_SIZE:
        return await asyncio.to_thread(func, *args)
    return func(*args)
