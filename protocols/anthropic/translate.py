"""Pure translation between Anthropic's Messages API and the gateway's own types.

Inbound: a validated `MessagesRequest` → one chat `GenerationRequest` (system, turns with their
content blocks, tools and `tool_choice` as a `ToolPlan`, `thinking` as the template's
`enable_thinking`, `output_config.format` as structured output, `output_config.effort` as the
template's `reasoning_effort`). Outbound: a `GenerationResult` → a `message` body, and events →
Anthropic's named SSE events (`message_start`, `content_block_*`, `message_delta`,
`message_stop`, `ping`). Tool calls and reasoning are read by the shared `ChoiceReader`
(protocols/common/tools.py), so a forced call's `input` always validates against its
`input_schema`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pydantic_core

from protocols.anthropic import schema
from protocols.common.bounds import bounded_max_tokens, stop_strings
from protocols.common.budget import VLLM_CUTS
from protocols.common.chat import template_kwargs, with_effort
from protocols.common.tools import ChoiceReader, Function, ToolPlan, check_parameters
from server.core.errors import InvalidRequest, Unsupported
from server.core.frozen import quick_init
from server.core.sampling import with_model_defaults
from server.core.types import (
    ChatMessage,
    ChatPrompt,
    Delta,
    Done,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
    ParsedOutput,
    Sampling,
    SamplingDefaults,
    Started,
    StructuredOutput,
    ToolCall,
    ToolCallPiece,
)
from server.http import jsonio
from server.http.context import RequestBounds

JSON = dict[str, Any]
PROTOCOL = "anthropic"
# What the request cannot set but the model's defaults may (as on /v1/chat/completions).
MODEL_DEFAULTED = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
NAMED_USAGE = 'Correct usage: `{"type": "tool", "name": "my_tool"}`'


# ---- inbound ---------------------------------------------------------------------------------


def tool_plan(body: schema.CountTokensRequest, *, tool_call_parser: str | None) -> ToolPlan:
    """`tools` and `tool_choice`: `any` is a forced call of any tool, `tool` of the named one
    (both constrained to the schema); `auto` (the default with tools) needs a tool-call parser,
    without one the tools are rendered and the answer is text (as the Responses API here)."""
    functions = _functions(body.tools or [])
    choice = body.tool_choice
    kind = choice.type if choice is not None else "auto"
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    if not functions:
        if kind in ("any", "tool"):
            raise InvalidRequest(
                f"tool_choice.type '{kind}' needs at least one tool in `tools`.",
                param="tool_choice",
            )
        return ToolPlan()
    if kind == "none" or (kind == "auto" and tool_call_parser is None):
        return ToolPlan(functions=functions, parallel=parallel)
    if kind == "auto":
        return ToolPlan(mode="auto", functions=functions, parallel=parallel)
    if kind == "any":
        return ToolPlan(mode="required", functions=functions, parallel=parallel)
    name = choice.name if choice is not None else None
    if not name or name not in {f.name for f in functions}:
        raise InvalidRequest(
            f"tool_choice names tool {name!r}, which is not in `tools`. {NAMED_USAGE}",
            param="tool_choice.name",
        )
    return ToolPlan(mode="named", functions=functions, function=name, parallel=parallel)


def _functions(tools: Sequence[schema.Tool]) -> tuple[Function, ...]:
    for index, tool in enumerate(tools):
        check_parameters(tool.input_schema, f"tools.{index}.input_schema")
    return tuple(
        Function(
            name=tool.name,
            description=tool.description,
            parameters={"type": "object", **tool.input_schema},
            strict=tool.strict,
        )
        for tool in tools
    )


def chat_prompt(body: schema.CountTokensRequest, plan: ToolPlan) -> ChatPrompt:
    """The conversation as the chat template renders it. A final assistant turn is continued
    (Anthropic's prefill); `thinking` and `output_config.effort` set template variables."""
    messages = list(_system(body.system))
    for index, message in enumerate(body.messages):
        messages += _turn(message, index)
    prefill = body.messages[-1].role == "assistant"
    return ChatPrompt(
        messages=tuple(messages),
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        chat_template_kwargs=_template_kwargs(body),
        tools=plan.tools_json,
    )


def _template_kwargs(body: schema.CountTokensRequest) -> tuple[tuple[str, Any], ...]:
    """`output_config.effort` is the template's `reasoning_effort` (as `reasoning_effort` on
    /v1/chat/completions); `thinking` sets `enable_thinking`. Disabled thinking drops the
    effort: vLLM applies `thinking` after `output_config` and replaces the effort."""
    thinking = body.thinking.type if body.thinking is not None else None
    effort = body.output_config.effort if body.output_config is not None else None
    kwargs = dict(with_effort(
        template_kwargs(body.chat_template_kwargs), None if thinking == "disabled" else effort
    ))
    if thinking is not None:
        kwargs.setdefault("enable_thinking", thinking != "disabled")
    return tuple(kwargs.items())


def output_format(body: schema.CountTokensRequest) -> schema.JsonOutputFormat | None:
    """`output_config.format`, or the beta's top-level `output_format` (not both)."""
    given = body.output_config.format if body.output_config is not None else None
    if body.output_format is None:
        return given
    if given is not None:
        raise InvalidRequest(
            "`output_format` and `output_config.format` cannot both be given; "
            "`output_format` is deprecated, use `output_config.format`.",
            param="output_format",
        )
    return body.output_format


def _structured(body: schema.CountTokensRequest, plan: ToolPlan) -> StructuredOutput | None:
    """A forced tool call (`any`, `tool`) is held to its schema even with a format given, as on
    vLLM's chat path: its tool parser's `adjust_request` replaces `response_format` by the
    tools' schema. Otherwise the format is vLLM's `response_format` of type json_schema."""
    fmt = output_format(body)
    if plan.forced or fmt is None:
        return plan.structured()
    return StructuredOutput(json_schema=jsonio.dumps(fmt.schema_).decode())


def _system(system: str | list[schema.TextBlock] | None) -> list[ChatMessage]:
    """Text blocks are joined as vLLM joins them (no separator)."""
    if system is None:
        return []
    text = system if isinstance(system, str) else "".join(block.text for block in system)
    return [ChatMessage("system", text)] if text else []


def _turn(message: schema.MessageParam, index: int) -> list[ChatMessage]:
    """One turn → chat messages: a user turn's tool results come first as `tool` messages (as
    vLLM orders them), then its text; an assistant turn carries its tool calls and thinking."""
    if isinstance(message.content, str):
        return [ChatMessage(message.role, message.content)]
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    results: list[ChatMessage] = []
    for number, block in enumerate(message.content):
        where = f"messages.{index}.content.{number}"
        if isinstance(block, schema.TextBlock):
            texts.append(block.text)
        elif isinstance(block, schema.ToolUseBlock | schema.ThinkingBlock):
            _only_in(message.role, "assistant", block.type, where)
            if isinstance(block, schema.ToolUseBlock):
                calls.append(ToolCall(id=block.id, name=block.name,
                                      arguments=jsonio.dumps(block.input).decode()))
            else:
                thoughts.append(block.thinking)
        elif isinstance(block, schema.ToolResultBlock):
            _only_in(message.role, "user", block.type, where)
            results.append(ChatMessage("tool", _result_text(block, where),
                                       tool_call_id=block.tool_use_id))
        elif not isinstance(block, schema.RedactedThinkingBlock):  # opaque: nothing to show
            raise _no_media(block.type, where)
    if message.role == "user":
        return results + ([ChatMessage("user", "\n".join(texts))] if texts else [])
    return [ChatMessage("assistant", "\n".join(texts), tool_calls=tuple(calls),
                        reasoning="".join(thoughts) or None)]


def _only_in(role: str, expected: str, block_type: str, where: str) -> None:
    if role != expected:
        raise InvalidRequest(
            f"`{block_type}` blocks may only appear in {expected} messages.", param=where
        )


def _result_text(block: schema.ToolResultBlock, where: str) -> str:
    if isinstance(block.content, str):
        return block.content
    for number, part in enumerate(block.content):
        if not isinstance(part, schema.TextBlock):
            raise _no_media(part.type, f"{where}.content.{number}")
    return "\n".join(part.text for part in block.content if isinstance(part, schema.TextBlock))


def _no_media(block_type: str, where: str) -> Unsupported:
    return Unsupported(
        f"Content blocks of type '{block_type}' are not supported: this model takes text only.",
        param=where,
    )


def message_request(
    body: schema.MessagesRequest,
    *,
    request_id: str,
    plan: ToolPlan,
    bounds: RequestBounds,
    defaults: SamplingDefaults,
    reasoning_parser: str | None = None,
) -> GenerationRequest:
    """One Messages request → one chat `GenerationRequest`. The answer is parsed when tools are
    called freely (`auto`) or a reasoning parser is configured (thinking blocks)."""
    prompt = chat_prompt(body, plan)
    parse = None
    if plan.mode == "auto" or reasoning_parser is not None:
        parse = plan.parse_spec(reasoning=True, template_kwargs=prompt.chat_template_kwargs)
    return GenerationRequest(
        request_id=request_id,
        model=body.model,
        prompt=prompt,
        sampling=_sampling(body, plan, bounds, defaults, _thinking_budget(body, reasoning_parser)),
        stream=bool(body.stream),
        protocol=PROTOCOL,
        parse=parse,
    )


def _thinking_budget(body: schema.MessagesRequest, reasoning_parser: str | None) -> int | None:
    """`thinking.budget_tokens` bounds the reasoning as vLLM's `thinking_token_budget` (as vLLM's
    Messages API maps it) where a reasoning parser can tell where reasoning ends; without one
    there is no reasoning to bound and the budget is only checked. It must be below
    `max_tokens`, as on Anthropic's API and vLLM's."""
    thinking = body.thinking
    if not isinstance(thinking, schema.ThinkingEnabled):
        return None
    if thinking.budget_tokens >= body.max_tokens:
        raise InvalidRequest(
            "thinking.budget_tokens must be less than max_tokens", param="thinking.budget_tokens"
        )
    return thinking.budget_tokens if reasoning_parser is not None else None


def _sampling(
    body: schema.MessagesRequest, plan: ToolPlan, bounds: RequestBounds,
    defaults: SamplingDefaults, thinking_budget: int | None,
) -> Sampling:
    """A field the request leaves out takes the model's default, else the neutral value. Stop
    sequences end text, not a forced call's JSON input (which they would cut to nothing)."""
    stop = stop_strings(body.stop_sequences, bounds, param="stop_sequences")
    sampling = Sampling(
        max_new_tokens=bounded_max_tokens(body.max_tokens, bounds),
        thinking_token_budget=thinking_budget,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        stop=() if plan.forced else stop,
        structured=_structured(body, plan),
        budget=VLLM_CUTS,  # as vLLM's chat path, which serves its Messages API
    )
    omitted = [name for name in ("temperature", "top_p", "top_k") if getattr(body, name) is None]
    return with_model_defaults(
        sampling, defaults, [*omitted, *MODEL_DEFAULTED], greedy=body.temperature == 0
    )


# ---- outbound --------------------------------------------------------------------------------


def _new_signature() -> str:
    """Thinking blocks carry a signature; nothing here verifies it (vLLM: a random hex)."""
    return uuid.uuid4().hex


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ReplyView:
    """What one answer repeats: its id and model name, the tool plan, the stop sequences."""

    id: str
    model: str
    plan: ToolPlan = field(default_factory=ToolPlan)
    stop_sequences: tuple[str, ...] = ()


def stop_reason(
    finish: FinishReason, matched: str | int | None, *, called: bool, view: ReplyView
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): `tool_use` when a call was made and the model stopped,
    `stop_sequence` naming the sequence that matched, `max_tokens`, else `end_turn`."""
    if finish is FinishReason.LENGTH:
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(matched, str) and matched in view.stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def tool_input(arguments: str) -> JSON:
    """A call's arguments as the object `input` is: a call cut off is read as far as it goes,
    as the SDK reads a streamed one (jiter's partial mode: an unfinished string is left out);
    an unreadable auto-parsed call is {}."""
    try:
        value = pydantic_core.from_json(arguments or "{}", allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(parsed: ParsedOutput) -> list[JSON]:
    """thinking, text, tool_use blocks; an empty answer is one empty text block."""
    blocks: list[JSON] = []
    if parsed.reasoning:
        blocks.append(
            {"type": "thinking", "thinking": parsed.reasoning, "signature": _new_signature()}
        )
    if parsed.content:
        blocks.append({"type": "text", "text": parsed.content})
    blocks += [
        {"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)}
        for call in parsed.tool_calls
    ]
    return blocks or [{"type": "text", "text": ""}]


def usage(input_tokens: int, output_tokens: int) -> JSON:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def message_response(result: GenerationResult, view: ReplyView, reader: ChoiceReader) -> JSON:
    choice = result.choices[0]
    # a call cut off by max_tokens stays, incomplete, as the stream shows it and as Anthropic's
    # API answers it ("Handling stop reasons": retry with a higher max_tokens)
    parsed = reader.whole(
        choice.text, choice.token_ids, result.prompt.prompt_token_ids,
        unfinished=choice.finish_reason is FinishReason.LENGTH,
    )
    reason, sequence = stop_reason(
        choice.finish_reason, choice.matched_stop, called=reader.called, view=view
    )
    return {
        "id": view.id,
        "type": "message",
        "role": "assistant",
        "model": view.model,
        "content": content_blocks(parsed),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(result.usage.prompt_tokens, result.usage.completion_tokens),
    }


def count_tokens_response(input_tokens: int) -> JSON:
    return {"input_tokens": input_tokens}


def event(kind: str, data: JSON) -> bytes:
    """One named SSE event; the SDK drops data lines without their `event:` line."""
    return b"event: " + kind.encode() + b"\ndata: " + jsonio.dumps(data) + b"\n\n"


PING = event("ping", {"type": "ping"})
MESSAGE_STOP = event("message_stop", {"type": "message_stop"})


class MessageStreamEncoder:
    """Events → Anthropic's stream: `message_start` and a `ping`, then content blocks opened,
    filled by deltas and closed as the reader splits the answer (thinking, text, tool_use), then
    `message_delta` with the stop reason and usage, and `message_stop`."""

    def __init__(self, view: ReplyView, reader: ChoiceReader) -> None:
        self._view = view
        self._reader = reader
        self._prompt_ids: tuple[int, ...] | None = None
        self._blocks = 0  # blocks started so far
        self._open: str | None = None  # the type of the block being filled
        self._call_blocks: dict[int, int] = {}  # tool-call index → its block's index
        self._finish = FinishReason.STOP
        self._matched: str | int | None = None
        # a reader that passes text through as content: deltas need no parsing
        self._plain = reader.passes_text
        self._text_head: bytes | None = None  # the open text block's delta event, up to its text

    def encode(self, item: GenerationEvent) -> bytes:
        if isinstance(item, Delta):
            head = self._text_head
            if head is not None and item.finish is None:  # a text block is open: most deltas
                if not item.text:
                    return b""
                return b"".join((head, jsonio.dumps_scalar(item.text), b"}}\n\n"))
            return self._delta(item)
        if isinstance(item, Started):
            return self._start(item)
        return self._done(item)

    def _start(self, started: Started) -> bytes:
        self._prompt_ids = started.prompt_token_ids
        message: JSON = {
            "id": self._view.id,
            "type": "message",
            "role": "assistant",
            "model": self._view.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(len(started.prompt_token_ids), 0),
        }
        return event("message_start", {"type": "message_start", "message": message}) + PING

    def _delta(self, delta: Delta) -> bytes:
        prompt_ids, self._prompt_ids = self._prompt_ids, None  # the reader wants them once
        parsed = self._reader.piece(
            delta.text, delta.token_ids, prompt_token_ids=prompt_ids,
            finished=delta.finish is not None,
        )
        if delta.finish is not None:
            self._finish, self._matched = delta.finish, delta.matched_stop
        if parsed is None:
            return b""
        out = b""
        if parsed.reasoning:
            out += self._into("thinking", {"type": "thinking_delta", "thinking": parsed.reasoning})
        if parsed.content:
            out += self._into("text", {"type": "text_delta", "text": parsed.content})
        for piece in parsed.tool_calls:
            out += self._call(piece)
        return out

    def _into(self, kind: str, delta: JSON) -> bytes:
        """A delta for a block of `kind`, opening one (and closing another) if needed."""
        out = b""
        if self._open != kind:
            block: JSON = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""
            out = self._close() + self._begin(kind, block)
        return out + self._block_delta(self._blocks - 1, delta)

    def _call(self, piece: ToolCallPiece) -> bytes:
        out = b""
        if piece.name is not None:
            block: JSON = {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
            out = self._close() + self._begin("tool_use", block)
            self._call_blocks[piece.index] = self._blocks - 1
        index = self._call_blocks.get(piece.index)
        if piece.arguments and index is not None:
            delta = {"type": "input_json_delta", "partial_json": piece.arguments}
            out += self._block_delta(index, delta)
        return out

    def _begin(self, kind: str, block: JSON) -> bytes:
        index = self._blocks
        self._blocks += 1
        self._open = kind
        if kind == "text" and self._plain:
            self._text_head = b"".join((
                b'event: content_block_delta\ndata: {"type":"content_block_delta","index":',
                str(index).encode(), b',"delta":{"type":"text_delta","text":',
            ))
        return event(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": block},
        )

    def _block_delta(self, index: int, delta: JSON) -> bytes:
        return event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )

    def _close(self) -> bytes:
        self._text_head = None
        if self._open is None:
            return b""
        index = self._blocks - 1
        out = b""
        if self._open == "thinking":
            out = self._block_delta(
                index, {"type": "signature_delta", "signature": _new_signature()}
            )
        self._open = None
        return out + event("content_block_stop", {"type": "content_block_stop", "index": index})

    def _done(self, done: Done) -> bytes:
        out = b""
        if self._blocks == 0:  # an empty answer still has one (empty) text block
            out = self._begin("text", {"type": "text", "text": ""})
        out += self._close()
        reason, sequence = stop_reason(
            self._finish, self._matched, called=self._reader.called, view=self._view
        )
        tokens = done.usage
        out += event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage(tokens.prompt_tokens, tokens.completion_tokens),
            },
        )
        return out + MESSAGE_STOP
