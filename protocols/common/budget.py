"""The prompt budget policies of the protocols served as vLLM serves them (server/core/budget.py
holds the rules; these are the choices and vLLM's words).

- `VLLM_REFUSES`: a limit the prompt leaves no room for is refused (MindIE, DJL/LMI, KServe v2:
  their servers run vLLM's engine, whose checks say this).
- `VLLM_CUTS`: vLLM 0.32's OpenAI server (`get_max_tokens`): the limit is cut to the room the
  prompt leaves; only a limit beyond the whole context is refused (OpenAI, and Anthropic's
  Messages API, which vLLM serves through its chat path).
"""

from __future__ import annotations

from server.core.budget import Ask, BudgetPolicy, BudgetWords, Overflow
from server.core.errors import ContextLengthExceeded, GatewayError, InvalidRequest


class VllmWords(BudgetWords):
    """vLLM's words for a prompt that does not fit and for a limit beyond the room."""

    def truncation_too_large(self, limit: int, context: int) -> GatewayError:
        return InvalidRequest(
            f"truncate_prompt_tokens={limit} cannot be greater than max_model_len = "
            f"{context}. Please request a smaller truncation size.",
            param="truncate_prompt_tokens",
        )

    def prompt_too_long(self, ask: Ask) -> GatewayError:
        return ContextLengthExceeded(
            f"This model's maximum context length is {ask.context} tokens. However, your "
            f"prompt contains {ask.prompt_tokens} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt."
        )

    def no_room(self, ask: Ask) -> GatewayError:
        return ContextLengthExceeded(
            f"This model's maximum context length is {ask.context} tokens. However, your prompt "
            f"contains {ask.prompt_tokens} input tokens, which leaves no room for any output "
            "tokens. Please reduce the length of the input prompt."
        )

    def too_many_new_tokens(self, ask: Ask) -> GatewayError:
        wanted, context, prompt = ask.new_tokens, ask.context, ask.prompt_tokens
        return InvalidRequest(
            f"'max_tokens' or 'max_completion_tokens' is too large: {wanted}. This model's "
            f"maximum context length is {context} tokens and your request has {prompt} "
            f"input tokens ({wanted} > {context} - {prompt}).",
            param="max_tokens",
        )


class VllmOpenAIWords(VllmWords):
    """vLLM 0.32's OpenAI server, which cuts: no room is a limit of 0, and only a limit beyond
    the context is refused."""

    def no_room(self, ask: Ask) -> GatewayError:
        return ContextLengthExceeded("max_tokens must be at least 1, got 0.", param="max_tokens")

    def too_many_new_tokens(self, ask: Ask) -> GatewayError:
        return InvalidRequest(
            f"max_tokens={ask.new_tokens} cannot be greater than max_model_len={ask.context}. "
            "Please request fewer output tokens.",
            param="max_tokens",
        )


VLLM_REFUSES = BudgetPolicy(overflow=Overflow.REFUSE, words=VllmWords())
VLLM_CUTS = BudgetPolicy(overflow=Overflow.CUT, words=VllmOpenAIWords())
