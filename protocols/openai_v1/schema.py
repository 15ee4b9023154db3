"""Wire models of the OpenAI API as vLLM serves it: request bodies only, validated at the edge.

Field names, types and defaults follow vLLM's `ChatCompletionRequest`, `CompletionRequest`,
`LoadLoRAAdapterRequest`, `TokenizeRequest` (PROTOCOLS.md §2). Unknown fields are ignored, as
vLLM does. Responses are plain dicts (`chat_replies.py`, `completion_replies.py`, `models.py`,
`tokenizer.py`; no pydantic on the hot path).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

TokenId = Annotated[int, Field(ge=0)]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Wire):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(_Wire):
    """What chat and completions share: OpenAI sampling fields plus vLLM's extras."""

    model: str | None = None
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM: one of json, regex, choice, grammar
    # vLLM extras (OpenAI SDK users pass them through `extra_body`)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] = Field(default_factory=list)
    thinking_token_budget: int | None = Field(None, ge=-1, strict=True)  # -1: unlimited
    priority: int = 0
    request_id: str | None = Field(None, min_length=1, max_length=256)
    echo: bool | None = False
    return_token_ids: bool | None = False
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search: score = cumulative logprob / length ** this
    prompt_logprobs: int | None = None
    # LoRAX's per-request composition (model = the base model); checked by
    # server.core.composition.merge_from_wire
    merged_adapters: Any = None
    # Dropped by vLLM 0.32 (V1 has no best-of sampling): bounded, and refused beyond `n`
    best_of: int | None = None

    @field_validator("n", mode="before")
    @classmethod
    def _null_n_is_one(cls, value: object) -> object:
        return 1 if value is None else value  # vLLM accepts `n: null`


class TextPart(_Wire):
    """One part of a list-valued message `content`. Only text parts are served here."""

    type: str
    text: str | None = None


class FunctionCallIn(_Wire):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(_Wire):
    """A call of an earlier assistant turn (history)."""

    id: str | None = None
    type: str = "function"
    function: FunctionCallIn


class ChatMessageIn(_Wire):
    role: str = Field(min_length=1, max_length=64)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns
    reasoning: str | None = None  # assistant turns (vLLM also reads `reasoning_content`)
    reasoning_content: str | None = None


class FunctionDefinition(_Wire):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(_Wire):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")  # vLLM fields not served: unserved.py
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: str | dict[str, Any] | None = "none"  # absent with tools: "auto"
    parallel_tool_calls: bool | None = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    include_reasoning: bool = True


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")  # vLLM fields not served: unserved.py
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] | None = None
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    prompt_embeds: Any = None
    tools: Any = None  # refused: completions have no tools
    tool_choice: Any = None


class LoadLoraAdapterRequest(_Wire):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoraAdapterRequest(_Wire):
    lora_name: str = ""
    lora_int_id: int | None = None


class TokenizeCompletionRequest(_Wire):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Wire):
    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Wire):
    model: str | None = None
    tokens: list[TokenId]


# ---- the Responses API ----------------------------------------------------------------------


class ResponsesTool(_Wire):
    """A tool of the Responses API: only function tools are served here."""

    type: str
    name: str | None = Field(None, min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseTextFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseText(_Wire):
    format: ResponseTextFormat | None = None
    verbosity: str | None = None


class ResponseReasoning(_Wire):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Wire):
    """vLLM's `ResponsesRequest` (the OpenAI Responses API), the fields served here."""
    model_config = ConfigDict(extra="allow")  # vLLM fields not served: unserved.py

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    tools: list[ResponsesTool] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool | None = True
    max_tool_calls: int | None = Field(None, ge=0)
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    text: ResponseText | None = None
    reasoning: ResponseReasoning | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    background: bool | None = False
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    prompt: Any = None
    service_tier: str | None = "auto"
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension
    request_id: str | None = Field(None, min_length=1, max_length=256)
    priority: int = 0
    # vLLM's sampling extras its Responses API applies (`ResponsesRequest.to_sampling_params`)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
