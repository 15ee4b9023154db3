"""Inbound OpenAI bodies (vLLM flavour) → the gateway's `GenerationRequest`s.

Chat and completion bodies: prompts, messages, sampling and logprob asks; bounds and vLLM's
cross-field rules are checked here, before the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict, cast

from protocols.common.bounds import bounded_max_tokens, stop_strings
from protocols.common.budget import VLLM_CUTS
from protocols.common.chat import template_kwargs, with_effort
from protocols.common.tools import ToolPlan
from protocols.common.unserved import refuse_unserved
from protocols.openai_v1 import schema, tools, unserved
from protocols.openai_v1.structured import to_structured
from server.core.budget import BudgetPolicy
from server.core.composition import merge_from_wire
from server.core.errors import InvalidRequest, Unsupported
from server.core.frozen import replaced
from server.core.types import (
    AdapterMerge,
    ChatMessage,
    ChatPrompt,
    GenerationRequest,
    OutputOptions,
    ParseSpec,
    Prompt,
    Sampling,
    SamplingDefaults,
    TextPrompt,
    TokenPrompt,
)
from server.http.context import RequestBounds

NO_DEFAULTS = SamplingDefaults()
TEXT_PART_TYPES = frozenset({"text", "input_text"})
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


def chat_request(
    body: schema.ChatCompletionRequest,
    *,
    request_id: str,
    bounds: RequestBounds,
    plan: ToolPlan | None = None,
    defaults: SamplingDefaults | None = None,
    parse: bool = False,
) -> GenerationRequest:
    """One chat completion → one `GenerationRequest` (default max tokens: the model's default,
    else the remaining context). `plan` is the request's validated tools (`tools.chat_plan`);
    `parse`: the answer goes through the engine's output parsers (reasoning, auto tools)."""
    _check_common(body, bounds)
    refuse_unserved(body.model_extra or {}, unserved.CHAT)
    plan = plan or tools.chat_plan(body, tool_call_parser=None)
    if body.continue_final_message and body.add_generation_prompt:
        raise InvalidRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    max_tokens = body.max_completion_tokens or body.max_tokens
    prompt = chat_prompt(body, tools_json=plan.tools_json)
    sampling = to_sampling(body, bounded_max_tokens(max_tokens, bounds), bounds, defaults)
    if plan.forced:
        sampling = replaced(sampling, structured=plan.structured())
    return GenerationRequest(
        request_id=request_id,
        model=body.model or "",
        prompt=prompt,
        sampling=sampling,
        output=OutputOptions(
            logprobs=_chat_logprobs(body, bounds), prompt_logprobs=prompt_logprobs(body, bounds)
        ),
        stream=bool(body.stream),
        protocol="openai",
        priority=body.priority,
        parse=chat_parse_spec(body, plan, prompt) if parse or plan.mode == "auto" else None,
        merge=merged_adapters(body),
    )


def chat_parse_spec(
    body: schema.ChatCompletionRequest, plan: ToolPlan, prompt: ChatPrompt
) -> ParseSpec:
    return plan.parse_spec(
        reasoning=body.include_reasoning, template_kwargs=prompt.chat_template_kwargs
    )


def completion_requests(
    body: schema.CompletionRequest,
    *,
    request_id: str,
    bounds: RequestBounds,
    defaults: SamplingDefaults | None = None,
) -> list[GenerationRequest]:
    """One completion body → one `GenerationRequest` per prompt (default max tokens 16)."""
    _check_common(body, bounds)
    if body.stream and body.use_beam_search:  # vLLM's completions refuse it; its chat streams
        raise InvalidRequest("Streaming is not currently supported with beam search")
    if body.use_beam_search and body.echo and body.logprobs is not None:
        raise InvalidRequest(
            "`echo` with `logprobs` is not supported with beam search because beam search "
            "does not compute prompt logprobs.", param="echo",
        )
    refuse_unserved(body.model_extra or {}, unserved.COMPLETION)
    if body.suffix is not None:
        raise Unsupported("suffix is not supported by this model.", param="suffix")
    if body.prompt_embeds is not None:
        raise Unsupported("prompt_embeds are not supported by this server.", param="prompt_embeds")
    if body.tools is not None or body.tool_choice is not None:
        raise InvalidRequest(
            "Completions have no tools: send `tools` to /v1/chat/completions.",
            param="tools" if body.tools is not None else "tool_choice",
        )
    logprobs = _completion_logprobs(body, bounds)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if max_tokens == 0 and not body.echo:
        raise InvalidRequest("max_tokens must be at least 1, got 0.", param="max_tokens")
    # echo with max_tokens=0 returns the prompt only; the engine still runs one step (vLLM).
    sampling = to_sampling(
        body, bounded_max_tokens(max(max_tokens, 1), bounds), bounds, defaults
    )
    echoed = logprobs if body.echo else None
    asked = [n for n in (prompt_logprobs(body, bounds), echoed) if n is not None]
    output = OutputOptions(logprobs=logprobs, prompt_logprobs=max(asked) if asked else None)
    merge = merged_adapters(body)
    return [
        GenerationRequest(
            request_id=request_id,
            model=body.model or "",
            prompt=prompt,
            sampling=sampling,
            output=output,
            stream=bool(body.stream),
            protocol="openai",
            priority=body.priority,
            merge=merge,
        )
        for prompt in completion_prompts(body, bounds)
    ]


def merged_adapters(body: schema.SamplingFields) -> AdapterMerge | None:
    """LoRAX's `merged_adapters` (an extra field): adapters composed for this request."""
    if body.merged_adapters is None:
        return None
    return merge_from_wire(body.merged_adapters)


def completion_prompts(body: schema.CompletionRequest, bounds: RequestBounds) -> list[Prompt]:
    """`prompt` as a string, a list of strings, token ids, or a list of token-id lists."""
    prompt = body.prompt
    if prompt is None:
        raise InvalidRequest(
            "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
        )
    if isinstance(prompt, str):
        return [TextPrompt(prompt, body.add_special_tokens)]
    if not prompt:
        raise InvalidRequest("Prompt cannot be empty.", param="prompt")
    if all(isinstance(item, int) for item in prompt):
        return [TokenPrompt(tuple(cast(list[int], prompt)))]
    if len(prompt) > bounds.max_prompts:
        raise InvalidRequest(
            f"At most {bounds.max_prompts} prompts are allowed in one request, got {len(prompt)}.",
            param="prompt",
        )
    return [_one_prompt(item, body.add_special_tokens) for item in prompt]


def _one_prompt(item: object, add_special_tokens: bool) -> Prompt:
    if isinstance(item, str):
        return TextPrompt(item, add_special_tokens)
    if isinstance(item, list) and item:
        return TokenPrompt(tuple(cast(list[int], item)))
    raise InvalidRequest("Prompt cannot be empty.", param="prompt")


def chat_prompt(
    body: schema.ChatCompletionRequest | schema.TokenizeChatRequest,
    *,
    tools_json: str | None = None,
) -> ChatPrompt:
    if body.chat_template is not None:
        raise InvalidRequest(UNTRUSTED_TEMPLATE, param="chat_template")
    kwargs = with_effort(
        template_kwargs(body.chat_template_kwargs), getattr(body, "reasoning_effort", None)
    )
    return ChatPrompt(
        messages=tuple(chat_message(m, i) for i, m in enumerate(body.messages)),
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=kwargs,
        tools=tools_json,
    )


def chat_message(message: schema.ChatMessageIn, index: int) -> ChatMessage:
    tools.check_tool_message(message, index)
    return ChatMessage(
        message.role,
        message_text(message, index),
        message.name,
        tool_calls=tools.history_calls(message, index),
        tool_call_id=message.tool_call_id,
        reasoning=message.reasoning or message.reasoning_content,
    )


def message_text(message: schema.ChatMessageIn, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type not in TEXT_PART_TYPES:
            raise Unsupported(
                f"Content part type '{part.type}' is not supported: this model takes text only.",
                param=f"messages.{index}.content",
            )
        texts.append(part.text or "")
    return "\n".join(texts)


def to_sampling(
    body: schema.SamplingFields,
    max_new_tokens: int | None,
    bounds: RequestBounds,
    defaults: SamplingDefaults | None = None,
) -> Sampling:
    return Sampling(
        max_new_tokens=max_new_tokens,
        min_new_tokens=body.min_tokens,
        n=body.n,
        **vllm_knobs(body, defaults or NO_DEFAULTS, bounds),
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
        bad_words=tuple(body.bad_words),
        thinking_token_budget=_budget(body.thinking_token_budget),
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        structured=to_structured(body),
        beam_search=body.use_beam_search,
        length_penalty=body.length_penalty,
    )


class VllmKnobs(TypedDict):
    """The `Sampling` fields chat, completions and the Responses API read alike from a body."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    logit_bias: tuple[tuple[int, float], ...]
    budget: BudgetPolicy


def vllm_knobs(
    body: schema.SamplingFields | schema.ResponsesRequest,
    defaults: SamplingDefaults,
    bounds: RequestBounds,
) -> VllmKnobs:
    """OpenAI's sampling fields and vLLM's extras (`ignore_eos`, `stop_token_ids`, ...): a
    field the request leaves out takes the model's default, else vLLM's neutral value. Callers
    unpack it before their structured output: a body with several faults is refused for the
    first of stop strings, `logit_bias`, structured output."""
    d = defaults
    return {
        "temperature": _first(body.temperature, d.temperature, 1.0),
        "top_p": _first(body.top_p, d.top_p, 1.0),
        "top_k": int(_first(body.top_k, d.top_k, 0)),
        "min_p": _first(body.min_p, d.min_p, 0.0),
        "seed": body.seed,
        "repetition_penalty": _first(body.repetition_penalty, d.repetition_penalty, 1.0),
        "presence_penalty": _first(body.presence_penalty, d.presence_penalty, 0.0),
        "frequency_penalty": _first(body.frequency_penalty, d.frequency_penalty, 0.0),
        "stop": stop_strings(body.stop, bounds),
        "stop_token_ids": tuple(body.stop_token_ids or ()),
        "ignore_eos": body.ignore_eos,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "skip_special_tokens": body.skip_special_tokens,
        "logit_bias": logit_bias(body.logit_bias),
        "budget": VLLM_CUTS,
    }


def _first(value: float | None, default: float | None, neutral: float) -> float:
    """A model default as a float (a body's floats are floats): the Responses API echoes the
    sampling it ran with."""
    if value is not None:
        return value
    return neutral if default is None else float(default)


def _budget(thinking_token_budget: int | None) -> int | None:
    """vLLM's `thinking_token_budget`: -1 is unlimited, as unset."""
    return None if thinking_token_budget == -1 else thinking_token_budget


def logit_bias(raw: Mapping[str, float] | None) -> tuple[tuple[int, float], ...]:
    """Keys are token ids written as strings; values are clamped to [-100, 100] (vLLM)."""
    if not raw:
        return ()
    bias = []
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequest(
                f"logit_bias key {key[:32]!r} is not a token id.", param="logit_bias"
            ) from None
        if token_id < 0:
            raise InvalidRequest(f"logit_bias key {token_id} is negative.", param="logit_bias")
        bias.append((token_id, min(100.0, max(-100.0, value))))
    return tuple(bias)


def _check_common(body: schema.SamplingFields, bounds: RequestBounds) -> None:
    options = body.stream_options
    if options is not None and options.model_fields_set and not body.stream:  # `{}` passes
        raise InvalidRequest(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    if body.n > bounds.max_n:
        raise InvalidRequest(f"n must be at most {bounds.max_n}, got {body.n}.", param="n")
    if body.use_beam_search and 2 * body.n > bounds.max_logprobs:  # each step asks 2 × n
        raise InvalidRequest(
            f"Requested sample logprobs of {2 * body.n}, which is greater than max allowed: "
            f"{bounds.max_logprobs}", param="logprobs",
        )
    _check_best_of(body, bounds)
    prompt_logprobs(body, bounds)


def _check_best_of(body: schema.SamplingFields, bounds: RequestBounds) -> None:
    """vLLM 0.32 ignores `best_of` (its V1 engine has no best-of sampling): `best_of == n`
    asks for nothing more and is served; beyond `n` it is refused rather than dropped."""
    best_of, n = body.best_of, body.n
    if best_of is None:
        return
    if not 1 <= best_of <= bounds.max_best_of:
        raise InvalidRequest(
            f"best_of must be between 1 and {bounds.max_best_of}, got {best_of}.", param="best_of"
        )
    if best_of < n:
        raise InvalidRequest(
            f"best_of must be greater than or equal to n, got n={n} and best_of={best_of}.",
            param="best_of",
        )
    if best_of > n:
        raise Unsupported(
            "best_of > n is not supported by this server (vLLM 0.32 has no best-of sampling); "
            "ask for n choices instead.",
            param="best_of",
        )


def prompt_logprobs(body: schema.SamplingFields, bounds: RequestBounds) -> int | None:
    """vLLM's `prompt_logprobs` (served where the engine can: not on CPU with LoRA)."""
    asked = body.prompt_logprobs
    if asked is None:
        return None
    if asked < -1:
        raise InvalidRequest(
            "`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs"
        )
    if asked == -1 or asked > bounds.max_logprobs:
        raise InvalidRequest(
            f"Requested prompt logprobs of {asked}, which is greater than max allowed: "
            f"{bounds.max_logprobs}",
            param="prompt_logprobs",
        )
    return asked


def _chat_logprobs(body: schema.ChatCompletionRequest, bounds: RequestBounds) -> int | None:
    top = body.top_logprobs or 0
    if top < -1:
        raise InvalidRequest("`top_logprobs` must be a positive value or -1.", param="top_logprobs")
    if top != 0 and not body.logprobs:
        raise InvalidRequest(
            "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
        )
    if not body.logprobs:
        return None
    return bounded_logprobs(top, bounds, "top_logprobs")


def _completion_logprobs(body: schema.CompletionRequest, bounds: RequestBounds) -> int | None:
    if body.logprobs is None:
        return None
    if body.logprobs < -1:
        raise InvalidRequest("`logprobs` must be a positive value or -1.", param="logprobs")
    return bounded_logprobs(body.logprobs, bounds, "logprobs")


def bounded_logprobs(requested: int, bounds: RequestBounds, param: str) -> int:
    if requested == -1 or requested > bounds.max_logprobs:
        raise InvalidRequest(
            f"Requested sample logprobs of {requested}, which is greater than max allowed: "
            f"{bounds.max_logprobs}",
            param=param,
        )
    return requested
