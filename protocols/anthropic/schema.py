"""Wire models of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): request
bodies only, validated at the edge.

Field names, types and bounds follow Anthropic's documentation and the `anthropic` SDK's
`MessageCreateParams`; vLLM's extra `chat_template_kwargs` is taken too, and so is the beta's
top-level `output_format` (older SDKs send it; current ones send `output_config.format`).
Unknown request fields are ignored (agents send newer ones), but content blocks are told apart
by their `type`: an unknown block type is a 400. Responses are plain dicts built in
`translate.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Wire):
    type: Literal["text"]
    text: str


class ImageBlock(_Wire):
    type: Literal["image"]
    source: dict[str, Any]


class DocumentBlock(_Wire):
    type: Literal["document"]
    source: dict[str, Any]


class ToolUseBlock(_Wire):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool | None = None


class ThinkingBlock(_Wire):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Wire):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(_Wire):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Wire):
    """A client tool (`type` absent or "custom"); Anthropic's server tools are not served."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None


class ToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingEnabled(_Wire):
    """Thinking with Anthropic's `budget_tokens` (required, at least 1024)."""

    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)


class ThinkingDisabled(_Wire):
    type: Literal["disabled"]


class ThinkingAdaptive(_Wire):
    """Thinking whose depth the model chooses."""

    type: Literal["adaptive"]


# told apart by `type`, so a missing budget reads `thinking.enabled.budget_tokens: Field required`
Thinking = Annotated[
    ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")
]


class JsonOutputFormat(_Wire):
    """`output_config.format`: the answer's text is JSON valid against `schema` (`type` may be
    left out, as vLLM takes it)."""

    type: Literal["json_schema"] = "json_schema"
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Wire):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class CountTokensRequest(_Wire):
    """What a prompt is made of: `/v1/messages/count_tokens` takes exactly this."""

    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the structured-outputs beta's name
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
