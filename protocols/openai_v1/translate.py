"""Pure translation between the OpenAI wire (vLLM flavour) and the gateway's own types.

Inbound: validated wire models → `GenerationRequest`s (bounds and vLLM's cross-field rules are
checked here, before the engine). Outbound: `GenerationResult` → vLLM's response dicts, and
events → SSE bytes through small per-request encoders. Shapes follow PROTOCOLS.md §2.1-2.6:
non-streamed bodies carry every field vLLM dumps (nulls included); stream chunks carry only the
fields vLLM sets. Stream chunks are plain dicts serialised by `jsonio` (no pydantic per token).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

from protocols.common import grammar
from protocols.common.bounds import bounded_max_tokens, stop_strings
from protocols.common.budget import VLLM_CUTS
from protocols.common.chat import template_kwargs, with_effort
from protocols.common.tools import ChoiceReader, ToolPlan, finish_reason
from protocols.common.unserved import refuse_unserved
from protocols.openai_v1 import schema, tools, unserved
from server.core.composition import merge_from_wire
from server.core.engine import OutputParser
from server.core.errors import InvalidRequest, Unsupported
from server.core.types import (
    AdapterMerge,
    ChatMessage,
    ChatPrompt,
    Choice,
    Delta,
    Done,
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
    OutputOptions,
    ParsedOutput,
    ParseSpec,
    Prompt,
    Sampling,
    SamplingDefaults,
    Started,
    StructuredOutput,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
    ToolCallPiece,
    Usage,
)
from server.http import jsonio
from server.http.context import RequestBounds
from server.http.streaming import sse_event

_T = TypeVar("_T")
TokenTexts = Callable[[list[int]], list[str]]
JSON = dict[str, Any]
# (token text, logprob or None, {token text: logprob} or None): one row of completion logprobs
LogprobRow = tuple[str, float | None, dict[str, float] | None]

MIN_LOGPROB = -9999.0  # vLLM clamps -inf to this so the JSON stays valid
NO_DEFAULTS = SamplingDefaults()
TEXT_PART_TYPES = frozenset({"text", "input_text"})
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


# ---- inbound ---------------------------------------------------------------------------------


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
        sampling = replace(sampling, structured=plan.structured())
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
        _message_text(message, index),
        message.name,
        tool_calls=tools.history_calls(message, index),
        tool_call_id=message.tool_call_id,
        reasoning=message.reasoning or message.reasoning_content,
    )


def _message_text(message: schema.ChatMessageIn, index: int) -> str:
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
    """A field the request leaves out takes the model's default, else vLLM's neutral value."""
    d = defaults or NO_DEFAULTS
    return Sampling(
        max_new_tokens=max_new_tokens,
        min_new_tokens=body.min_tokens,
        temperature=_or(body.temperature, _or(d.temperature, 1.0)),
        top_p=_or(body.top_p, _or(d.top_p, 1.0)),
        top_k=_or(body.top_k, _or(d.top_k, 0)),
        min_p=_or(body.min_p, _or(d.min_p, 0.0)),
        seed=body.seed,
        repetition_penalty=_or(body.repetition_penalty, _or(d.repetition_penalty, 1.0)),
        presence_penalty=_or(body.presence_penalty, _or(d.presence_penalty, 0.0)),
        frequency_penalty=_or(body.frequency_penalty, _or(d.frequency_penalty, 0.0)),
        n=body.n,
        stop=stop_strings(body.stop, bounds),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        logit_bias=logit_bias(body.logit_bias),
        allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
        bad_words=tuple(body.bad_words),
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        structured=to_structured(body),
        budget=VLLM_CUTS,
    )


def to_structured(body: schema.SamplingFields) -> StructuredOutput | None:
    """`response_format` (json_object, json_schema; TGI's `{"type", "value"}` forms, which its
    clients send to the same route) or vLLM's `structured_outputs`."""
    if body.structured_outputs:
        return vllm_structured(body.structured_outputs)
    fmt = body.response_format or {}
    kind = fmt.get("type", "text")
    if "value" in fmt:
        return grammar.to_structured(fmt, field="response_format", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema_ = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema_, dict):
            raise InvalidRequest(
                "response_format.json_schema.schema must be a JSON object.",
                param="response_format",
            )
        return StructuredOutput(json_schema=jsonio.dumps(schema_).decode())
    raise Unsupported(
        f"response_format type {str(kind)[:32]!r} is not supported by this server.",
        param="response_format",
    )


def vllm_structured(spec: Mapping[str, Any]) -> StructuredOutput:
    chosen = [k for k in ("json", "regex", "choice", "grammar", "json_object") if spec.get(k)]
    if len(chosen) != 1:
        raise InvalidRequest(
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object.",
            param="structured_outputs",
        )
    value = spec[chosen[0]]
    checks: dict[str, Callable[[Any], bool]] = {
        "json": lambda v: isinstance(v, dict | str),
        "regex": lambda v: isinstance(v, str),
        "grammar": lambda v: isinstance(v, str),
        "choice": lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v),
        "json_object": lambda v: v is True,
    }
    if not checks[chosen[0]](value):
        raise InvalidRequest(
            f"structured_outputs.{chosen[0]} has the wrong type.", param="structured_outputs"
        )
    if chosen[0] == "json":
        text = value if isinstance(value, str) else jsonio.dumps(value).decode()
        return StructuredOutput(json_schema=text)
    if chosen[0] == "choice":
        return StructuredOutput(choice=tuple(value))
    return StructuredOutput(
        regex=spec.get("regex"),
        grammar=spec.get("grammar"),
        json_object=bool(spec.get("json_object")),
    )


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
    if body.use_beam_search:
        raise Unsupported("Beam search is not supported by this server.", param="use_beam_search")
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
    return _bounded_logprobs(top, bounds, "top_logprobs")


def _completion_logprobs(body: schema.CompletionRequest, bounds: RequestBounds) -> int | None:
    if body.logprobs is None:
        return None
    if body.logprobs < -1:
        raise InvalidRequest("`logprobs` must be a positive value or -1.", param="logprobs")
    return _bounded_logprobs(body.logprobs, bounds, "logprobs")


def _bounded_logprobs(requested: int, bounds: RequestBounds, param: str) -> int:
    if requested == -1 or requested > bounds.max_logprobs:
        raise InvalidRequest(
            f"Requested sample logprobs of {requested}, which is greater than max allowed: "
            f"{bounds.max_logprobs}",
            param=param,
        )
    return requested


def _or(value: _T | None, default: _T) -> _T:
    return default if value is None else value


# ---- outbound: shared pieces ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplyMeta:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamUsage:
    include: bool = False
    continuous: bool = False

    @classmethod
    def of(cls, body: schema.SamplingFields) -> StreamUsage:
        options = body.stream_options
        include = bool(options and options.include_usage)
        return cls(
            include=include, continuous=include and bool(options and options.continuous_usage_stats)
        )


def usage_dict(usage: Usage) -> JSON:
    """Usage of a non-streamed body: every field, nulls included."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "total_tokens": usage.total_tokens,
        "completion_tokens": usage.completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _stream_usage(prompt_tokens: int, completion_tokens: int) -> JSON:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


_TEXT_ONLY_TAIL = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}'


class _ChunkWriter:
    """Stream chunks share `id`, `object`, `created`, `model`: serialise that head once."""

    def __init__(self, meta: ReplyMeta, obj: str) -> None:
        head = jsonio.dumps(
            {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model}
        )
        self._prefix = head[:-1] + b',"choices":['

    def text_chunk(self, index: int, text: str) -> bytes:
        """`chunk()` of a chat choice that carries only text: most chunks of a stream, written
        without building and serialising a dict (the same bytes)."""
        return sse_event(
            b"".join(
                (self._prefix, b'{"index":', str(index).encode(), b',"delta":{"content":',
                 jsonio.dumps(text), _TEXT_ONLY_TAIL)
            )
        )

    def chunk(self, choice: JSON | None, usage: JSON | None = None, **extra: Any) -> bytes:
        parts = [self._prefix, b"" if choice is None else jsonio.dumps(choice), b"]"]
        if usage is not None:
            parts += [b',"usage":', jsonio.dumps(usage)]
        for key, value in extra.items():
            parts += [b',"', key.encode(), b'":', jsonio.dumps(value)]
        parts.append(b"}")
        return sse_event(b"".join(parts))


# ---- chat completions -----------------------------------------------------------------------


def _no_parser() -> OutputParser | None:
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatView:
    """How one chat request wants its answer rendered. `parser` makes a fresh output parser
    for each choice (reasoning, auto tool calls), None when none is configured."""

    meta: ReplyMeta
    n: int = 1
    logprobs: bool = False
    echo_prefix: str = ""
    usage: StreamUsage = field(default_factory=StreamUsage)
    return_token_ids: bool = False
    tools: ToolPlan = field(default_factory=ToolPlan)
    parser: Callable[[], OutputParser | None] = _no_parser
    parsed: bool = False  # the answer goes through a reader (tools or an output parser)
    prompt_logprobs: bool = False

    @classmethod
    def of(
        cls,
        body: schema.ChatCompletionRequest,
        meta: ReplyMeta,
        *,
        tools: ToolPlan | None = None,
        parser: Callable[[], OutputParser | None] = _no_parser,
        parsed: bool = False,
    ) -> ChatView:
        last = body.messages[-1]
        echo = ""
        if body.echo and last.role == "assistant":
            echo = _message_text(last, len(body.messages) - 1)
        plan = tools or ToolPlan()
        return cls(
            meta=meta,
            n=body.n,
            logprobs=bool(body.logprobs),
            echo_prefix=echo,
            usage=StreamUsage.of(body),
            return_token_ids=bool(body.return_token_ids),
            tools=plan,
            parser=parser,
            parsed=parsed or plan.mode != "none",
            prompt_logprobs=body.prompt_logprobs is not None,
        )

    def reader(self) -> ChoiceReader | None:
        return ChoiceReader(self.tools, self.parser()) if self.parsed else None


def chat_logprob(lp: TokenLogprob) -> JSON:
    return {
        "token": lp.token,
        "logprob": _clamp(lp.logprob),
        "bytes": list(lp.token.encode()),
        "top_logprobs": [
            {"token": t.token, "logprob": _clamp(t.logprob), "bytes": list(t.token.encode())}
            for t in lp.top
        ],
    }


def chat_response(result: GenerationResult, view: ChatView) -> JSON:
    prompt_ids = list(result.prompt.prompt_token_ids) if view.return_token_ids else None
    return {
        "id": view.meta.id,
        "object": "chat.completion",
        "created": view.meta.created,
        "model": view.meta.model,
        "choices": [
            _chat_choice(choice, view, result.prompt.prompt_token_ids) for choice in result.choices
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_dict(result.usage),
        "prompt_logprobs": prompt_logprobs_json(result.prompt) if view.prompt_logprobs else None,
        "prompt_token_ids": prompt_ids,
        "kv_transfer_params": None,
    }


def _chat_choice(choice: Choice, view: ChatView, prompt_ids: Sequence[int] = ()) -> JSON:
    logprobs = {"content": [chat_logprob(lp) for lp in choice.logprobs]} if view.logprobs else None
    reader = view.reader()
    finish = choice.finish_reason.value
    parsed = ParsedOutput(content=view.echo_prefix + choice.text)
    if reader is not None:
        parsed = _parsed(reader.whole(choice.text, choice.token_ids, prompt_ids), view)
        finish = finish_reason(reader, view.tools, finish)
    message: JSON = {
        "role": "assistant",
        "content": parsed.content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if parsed.tool_calls:
        message["tool_calls"] = [tool_call(piece) for piece in parsed.tool_calls]
    message["reasoning"] = parsed.reasoning
    return {
        "index": choice.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish,
        "stop_reason": choice.matched_stop,
        "token_ids": list(choice.token_ids) if view.return_token_ids else None,
    }


def _parsed(parsed: ParsedOutput, view: ChatView) -> ParsedOutput:
    """vLLM's content of a parsed answer: forced calls leave "", auto calls None when no text
    came before them, anything else the text (after an echoed prefix)."""
    content = parsed.content
    if view.tools.forced:
        content = content or ""
    elif content is not None or not parsed.tool_calls:
        content = view.echo_prefix + (content or "")
    return replace(parsed, content=content)


def tool_call(piece: ToolCallPiece) -> JSON:
    return {
        "id": piece.id,
        "type": "function",
        "function": {"name": piece.name, "arguments": piece.arguments},
    }


def tool_call_delta(piece: ToolCallPiece) -> JSON:
    """A streamed piece: the first of a call has id, type and name."""
    function: JSON = {}
    if piece.name is not None:
        function["name"] = piece.name
    if piece.arguments or piece.name is None:
        function["arguments"] = piece.arguments
    if piece.id is None:
        return {"index": piece.index, "function": function}
    return {"id": piece.id, "type": "function", "index": piece.index, "function": function}


class ChatStreamEncoder:
    """Events → `chat.completion.chunk` SSE bytes, chunk for chunk as vLLM 0.32 writes them
    (PROTOCOLS.md §2.1): one chunk per engine output, the last one carrying `finish_reason`."""

    def __init__(self, view: ChatView) -> None:
        self._view = view
        self._out = _ChunkWriter(view.meta, "chat.completion.chunk")
        self._prompt_tokens = 0
        self._prompt_ids: tuple[int, ...] = ()
        self._generated = [0] * view.n
        # chunks that carry only text: no logprobs, token ids or per-chunk usage asked for
        self._plain = not (view.logprobs or view.return_token_ids or view.usage.continuous)
        self._readers = [view.reader() for _ in range(view.n)] if view.parsed else []
        self._fed: set[int] = set()  # choices whose reader has had its first piece

    def encode(self, event: GenerationEvent) -> bytes:
        if isinstance(event, Delta):
            return self._output(event)
        if isinstance(event, Started):
            return self._start(event)
        return self._done(event)

    def _usage(self, choice: int) -> JSON | None:
        if not self._view.usage.continuous:
            return None
        usage = _stream_usage(self._prompt_tokens, self._generated[choice])
        usage["completion_tokens_details"] = None
        return usage

    def _start(self, event: Started) -> bytes:
        self._prompt_tokens = len(event.prompt_token_ids)
        self._prompt_ids = event.prompt_token_ids
        view = self._view
        prompt_ids = list(event.prompt_token_ids) if view.return_token_ids else None
        chunks = [
            self._out.chunk(
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                },
                self._usage(i),
                prompt_token_ids=prompt_ids,
                prompt_text=None,
            )
            for i in range(view.n)
        ]
        if view.echo_prefix:
            chunks += [
                self._out.chunk(
                    {
                        "index": i,
                        "delta": {"content": view.echo_prefix},
                        "logprobs": None,
                        "finish_reason": None,
                    },
                    self._usage(i),
                )
                for i in range(view.n)
            ]
        return b"".join(chunks)

    def _output(self, event: Delta) -> bytes:
        if event.finish is None and not event.text and not event.token_ids:
            return b""
        i, view = event.choice, self._view
        self._generated[i] += len(event.token_ids)
        if self._readers:
            return self._read(event, self._readers[i])
        if self._plain and event.finish is None:
            return self._out.text_chunk(i, event.text)
        logprobs = None
        if view.logprobs:
            logprobs = {"content": [chat_logprob(lp) for lp in event.logprobs]}
        choice: JSON = {
            "index": i,
            "delta": {"content": event.text},
            "logprobs": logprobs,
            "finish_reason": None,
        }
        if event.finish is not None:
            choice["finish_reason"] = event.finish.value
            choice["stop_reason"] = event.matched_stop
        choice["token_ids"] = list(event.token_ids) if view.return_token_ids else None
        return self._out.chunk(choice, self._usage(i))

    def _read(self, event: Delta, reader: ChoiceReader | None) -> bytes:
        """A parsed answer: reasoning, content and tool-call pieces as the reader decides them;
        the finish rides on the last content chunk, or on an empty delta after tool calls."""
        assert reader is not None
        i, view = event.choice, self._view
        first = i not in self._fed
        self._fed.add(i)
        parsed = reader.piece(
            event.text, event.token_ids,
            prompt_token_ids=self._prompt_ids if first else None,
            finished=event.finish is not None,
        )
        delta = _delta(parsed)
        if event.finish is None and not delta:
            return b""  # nothing decided yet: the parser holds the text back
        logprobs = None
        if view.logprobs:
            logprobs = {"content": [chat_logprob(lp) for lp in event.logprobs]}
        choice: JSON = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        if event.finish is None:
            choice["token_ids"] = list(event.token_ids) if view.return_token_ids else None
            return self._out.chunk(choice, self._usage(i))
        finish = finish_reason(reader, view.tools, event.finish.value)
        out = b""
        if "tool_calls" in delta:
            out = self._out.chunk({**choice, "token_ids": None}, self._usage(i))
            choice = {"index": i, "delta": {}, "logprobs": None, "finish_reason": None}
        choice["finish_reason"] = finish
        choice["stop_reason"] = event.matched_stop
        choice["token_ids"] = list(event.token_ids) if view.return_token_ids else None
        return out + self._out.chunk(choice, self._usage(i))

    def _done(self, event: Done) -> bytes:
        if not self._view.usage.include:
            return b""
        usage = event.usage
        return self._out.chunk(None, _stream_usage(usage.prompt_tokens, usage.completion_tokens))


def _delta(parsed: ParsedOutput | None) -> JSON:
    """A chunk's `delta` of parsed pieces, with only the keys that have something."""
    delta: JSON = {}
    if parsed is None:
        return delta
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.reasoning:
        delta["reasoning"] = parsed.reasoning
    if parsed.tool_calls:
        delta["tool_calls"] = [tool_call_delta(piece) for piece in parsed.tool_calls]
    return delta


# ---- completions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionView:
    """How one completion request wants its answer rendered.

    `echo_texts[k]` is prompt k's text for `echo` when the engine's `Started` does not carry it;
    `token_texts` names prompt tokens that carry no logprob.
    """

    meta: ReplyMeta
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    echo_only: bool = False
    echo_texts: tuple[str | None, ...] = ()
    usage: StreamUsage = field(default_factory=StreamUsage)
    return_token_ids: bool = False
    prompt_logprobs: bool = False
    token_texts: TokenTexts = field(default=lambda ids: ["" for _ in ids])

    @classmethod
    def of(
        cls,
        body: schema.CompletionRequest,
        meta: ReplyMeta,
        *,
        prompts: Sequence[Prompt],
        token_texts: TokenTexts,
    ) -> CompletionView:
        return cls(
            meta=meta,
            n=body.n,
            logprobs=body.logprobs,
            echo=bool(body.echo),
            echo_only=bool(body.echo) and body.max_tokens == 0,
            echo_texts=tuple(_prompt_text(p, token_texts) for p in prompts),
            usage=StreamUsage.of(body),
            return_token_ids=bool(body.return_token_ids),
            prompt_logprobs=body.prompt_logprobs is not None,
            token_texts=token_texts,
        )


def _prompt_text(prompt: Prompt, token_texts: TokenTexts) -> str | None:
    if isinstance(prompt, TextPrompt):
        return prompt.text
    if isinstance(prompt, TokenPrompt):
        return "".join(token_texts(list(prompt.token_ids)))
    return None


class _Echo:
    """The prompt side of a choice (prompt k = choice // n): text, logprob rows, token ids,
    from the `Started` of that prompt."""

    def __init__(self, view: CompletionView) -> None:
        self._view = view
        self._started: dict[int, Started] = {}
        self._rows: dict[int, list[LogprobRow]] = {}

    def start(self, started: Started) -> None:
        self._started[started.prompt_index] = started

    def started(self, choice: int) -> Started | None:
        return self._started.get(choice // self._view.n)

    def text(self, choice: int) -> str:
        k = choice // self._view.n
        started = self._started.get(k)
        if started is not None and started.prompt_text is not None:
            return started.prompt_text
        texts = self._view.echo_texts
        return (texts[k] if k < len(texts) else None) or ""

    def rows(self, choice: int) -> list[LogprobRow]:
        k = choice // self._view.n
        started = self._started.get(k)
        if started is None:
            return []
        if k not in self._rows:
            self._rows[k] = prompt_rows(started, self._view.token_texts)
        return self._rows[k]

    def start_offset(self, choice: int) -> int:
        """Text offset of the first logprob row: past the prompt when its rows are unknown."""
        return 0 if self.rows(choice) else len(self.text(choice))

    def prompt_token_ids(self, choice: int) -> list[int] | None:
        started = self._started.get(choice // self._view.n)
        return None if started is None else list(started.prompt_token_ids)

    def prompt_tokens(self, choice: int) -> int:
        started = self._started.get(choice // self._view.n)
        return 0 if started is None else len(started.prompt_token_ids)


def logprob_row(lp: TokenLogprob) -> LogprobRow:
    """Completion rows list the sampled token first, then the top alternatives."""
    top = {lp.token: _clamp(lp.logprob)}
    for alt in lp.top:
        top.setdefault(alt.token, _clamp(alt.logprob))
    return (lp.token, _clamp(lp.logprob), top)


def prompt_rows(started: Started, token_texts: TokenTexts) -> list[LogprobRow]:
    ids = list(started.prompt_token_ids)
    known = started.prompt_logprobs
    texts = token_texts(ids)
    rows: list[LogprobRow] = []
    for index, text in enumerate(texts):
        lp = known[index] if index < len(known) else None
        rows.append(logprob_row(lp) if lp is not None else (text, None, None))
    return rows


def completion_logprobs(rows: Iterable[LogprobRow], offset: int = 0) -> tuple[JSON, int]:
    """vLLM's `CompletionLogProbs`, and the text offset after its last token."""
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []
    for token, logprob, top in rows:
        text_offset.append(offset)
        offset += len(token)
        tokens.append(token)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
    body = {
        "text_offset": text_offset,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }
    return body, offset


def completion_response(result: GenerationResult, view: CompletionView) -> JSON:
    echo = _Echo(view)
    for started in result.prompts:
        echo.start(started)
    return {
        "id": view.meta.id,
        "object": "text_completion",
        "created": view.meta.created,
        "model": view.meta.model,
        "choices": [_completion_choice(choice, view, echo) for choice in result.choices],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_dict(result.usage),
        "kv_transfer_params": None,
    }


def _completion_choice(choice: Choice, view: CompletionView, echo: _Echo) -> JSON:
    text = "" if view.echo_only else choice.text
    rows = [] if view.echo_only else [logprob_row(lp) for lp in choice.logprobs]
    offset = 0
    if view.echo:
        text = echo.text(choice.index) + text
        if view.logprobs is not None:
            rows = echo.rows(choice.index) + rows
            offset = echo.start_offset(choice.index)
    prompt_ids = echo.prompt_token_ids(choice.index) if view.return_token_ids else None
    return {
        "index": choice.index,
        "text": text,
        "logprobs": completion_logprobs(rows, offset)[0] if view.logprobs is not None else None,
        "finish_reason": choice.finish_reason.value,
        "stop_reason": choice.matched_stop,
        "prompt_logprobs": (
            prompt_logprobs_json(echo.started(choice.index)) if view.prompt_logprobs else None
        ),
        "prompt_token_ids": prompt_ids,
        "token_ids": list(choice.token_ids) if view.return_token_ids else None,
    }


def prompt_logprobs_json(started: Started | None) -> list[JSON | None] | None:
    """vLLM's prompt logprobs: per prompt token (the first has none) the token and the best
    alternatives, each `{token id: {"logprob", "rank", "decoded_token"}}`."""
    if started is None or not started.prompt_logprobs:
        return None
    out: list[JSON | None] = []
    for entry in started.prompt_logprobs:
        if entry is None:
            out.append(None)
            continue
        position: JSON = {
            str(entry.token_id): _ranked(entry.logprob, entry.rank, entry.token)
        }
        for alt in entry.top:
            position.setdefault(str(alt.token_id), _ranked(alt.logprob, alt.rank, alt.token))
        out.append(position)
    return out


def _ranked(logprob: float, rank: int | None, token: str) -> JSON:
    return {"logprob": _clamp(logprob), "rank": rank, "decoded_token": token}


class CompletionStreamEncoder:
    """Events → `text_completion` SSE bytes, chunk for chunk as vLLM 0.32 writes them
    (PROTOCOLS.md §2.2); with `echo` the prompt rides on each choice's first chunk."""

    def __init__(self, view: CompletionView) -> None:
        self._view = view
        self._out = _ChunkWriter(view.meta, "text_completion")
        self._echo = _Echo(view)
        self._opened: set[int] = set()  # choices that sent their first chunk
        self._offsets: dict[int, int] = {}
        self._generated: dict[int, int] = {}

    def encode(self, event: GenerationEvent) -> bytes:
        if isinstance(event, Delta):
            return self._output(event)
        if isinstance(event, Started):
            self._echo.start(event)
            return b""
        return self._done(event)

    def _output(self, event: Delta) -> bytes:
        i, view = event.choice, self._view
        first = i not in self._opened
        end = event.finish
        if end is None and not first and not event.text and not event.token_ids:
            return b""
        self._opened.add(i)
        self._generated[i] = self._generated.get(i, 0) + len(event.token_ids)
        text = "" if view.echo_only else event.text
        rows = (
            []
            if view.echo_only or view.logprobs is None
            else [logprob_row(lp) for lp in event.logprobs]
        )
        prompt_ids = None
        if first and view.echo:
            text = self._echo.text(i) + text
            if view.logprobs is not None:
                rows = self._echo.rows(i) + rows
                self._offsets[i] = self._echo.start_offset(i)
        if first and (view.echo or view.return_token_ids):
            prompt_ids = self._echo.prompt_token_ids(i)
        choice = {
            "index": i,
            "text": text,
            "logprobs": self._logprobs(i, rows),
            "finish_reason": None if end is None else end.value,
            "stop_reason": None if end is None else event.matched_stop,
            "prompt_token_ids": prompt_ids,
            "token_ids": list(event.token_ids) if view.return_token_ids else None,
        }
        return self._out.chunk(choice, self._usage(i))

    def _done(self, event: Done) -> bytes:
        if not self._view.usage.include:
            return b""
        usage = event.usage
        return self._out.chunk(None, _stream_usage(usage.prompt_tokens, usage.completion_tokens))

    def _logprobs(self, choice: int, rows: list[LogprobRow]) -> JSON | None:
        if self._view.logprobs is None:
            return None
        body, self._offsets[choice] = completion_logprobs(rows, self._offsets.get(choice, 0))
        return body

    def _usage(self, choice: int) -> JSON | None:
        if not self._view.usage.continuous:
            return None
        return _stream_usage(self._echo.prompt_tokens(choice), self._generated.get(choice, 0))


# ---- models, tokenizer ------------------------------------------------------------------------


def _permission(created: int) -> JSON:
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def model_card(
    name: str,
    *,
    created: int,
    parent: str | None = None,
    max_model_len: int | None = None,
    root: str | None = None,
) -> JSON:
    """vLLM's `ModelCard`. `root` is the weights' or adapter's path as vLLM shows it, but only
    to admin callers; others see the served name (RELIABILITY_PERF.md B.5: /v1/models must not
    reveal where weights live to every client)."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root or name,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [_permission(created)],
    }


def model_list(
    base_names: Sequence[str],
    adapters: Sequence[str],
    *,
    created: int,
    max_model_len: int,
    roots: Mapping[str, str] | None = None,
) -> JSON:
    """Base models first (`parent` null), then every loaded adapter (`parent` = first base).
    `roots` (name → path) is given for admin callers only."""
    shown = roots or {}
    data = [
        model_card(name, created=created, max_model_len=max_model_len, root=shown.get(name))
        for name in base_names
    ]
    data += [
        model_card(name, created=created, parent=base_names[0], root=shown.get(name))
        for name in adapters
    ]
    return {"object": "list", "data": data}


def model_object(name: str, *, created: int, parent: str | None) -> JSON:
    """`GET /v1/models/{model}` in MindIE's shape (`parent` only for adapters)."""
    card: JSON = {"id": name, "object": "model", "created": created, "owned_by": "vllm"}
    if parent is not None:
        card["parent"] = parent
    return card


def tokenize_response(
    token_ids: list[int], *, max_model_len: int, token_strs: list[str] | None
) -> JSON:
    return {
        "count": len(token_ids),
        "max_model_len": max_model_len,
        "tokens": token_ids,
        "token_strs": token_strs,
    }
