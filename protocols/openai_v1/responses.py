"""The OpenAI Responses API (`/v1/responses`) as vLLM 0.32 serves it, on the chat machinery.

Inbound: `input` (text or items: messages, `function_call`, `function_call_output`,
`reasoning`), `instructions`, function `tools` and `tool_choice` (the chat tool plans of
`tools.py`), `text.format`, `reasoning.effort` → one chat `GenerationRequest`. Outbound: the
`Response` object with every field vLLM writes, and the typed event stream the SDK reads
(`response.created` … `response.completed`; SSE with `event:` lines and no `[DONE]`).

Where vLLM falls short, this does what OpenAI documents: `store` (default true) keeps responses
in memory, so `previous_response_id` and `GET /v1/responses/{id}` work (vLLM needs an env var and
then drops earlier function calls from the history); a failure mid-stream is an `error` event.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from protocols.common.chat import response_model, template_kwargs, with_effort
from protocols.common.tools import ChoiceReader, Function, Mode, ToolPlan, check_parameters
from protocols.common.unserved import refuse_unserved
from protocols.openai_v1 import schema, unserved
from protocols.openai_v1.chat_replies import chat_logprob
from protocols.openai_v1.errors import ResponseNotFound, status_and_type
from protocols.openai_v1.requests import TEXT_PART_TYPES, bounded_logprobs, vllm_knobs
from protocols.openai_v1.structured import vllm_structured
from server.core.engine import OutputParser
from server.core.errors import GatewayError, InvalidRequest, Unsupported
from server.core.peers import Peers
from server.core.types import (
    ChatMessage,
    ChatPrompt,
    Delta,
    Done,
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
    OutputOptions,
    ParsedOutput,
    Sampling,
    SamplingDefaults,
    Started,
    StructuredOutput,
    TokenLogprob,
    ToolCall,
    ToolCallPiece,
    Usage,
)
from server.http import jsonio
from server.http.context import RequestBounds

JSON = dict[str, Any]
STORE_CAPACITY = 1000  # responses kept for previous_response_id and GET, the oldest dropped first
INCOMPLETE = {"reason": "max_output_tokens"}


def _hex() -> str:
    return uuid.uuid4().hex[:16]


# ---- the store --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Stored:
    """A finished response and the conversation it ends (input and output, no system turns)."""

    response: JSON
    conversation: tuple[ChatMessage, ...]


PEER_GET = "openai.responses.get"  # another worker asks for a response stored here


class ResponseStore:
    """The last `capacity` stored responses of this process, in memory (a restart forgets
    them). With several workers, one stored by another worker is fetched from it (`pull`)."""

    def __init__(self, capacity: int = STORE_CAPACITY, peers: Peers | None = None) -> None:
        self._capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._peers = peers or Peers()
        self._peers.handle(PEER_GET, self._find)

    def get(self, response_id: str) -> Stored:
        stored = self._items.get(response_id)
        if stored is None:
            raise ResponseNotFound(f"Response with id '{response_id}' not found.")
        self._items.move_to_end(response_id)
        return stored

    async def pull(self, response_id: str | None) -> None:
        """Make a response stored by another worker available to `get` here."""
        if not response_id or response_id in self._items:
            return
        found = [s for s in await self._peers.ask(PEER_GET, response_id) if s is not None]
        if found:
            self.put(response_id, found[0])

    def put(self, response_id: str, stored: Stored) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    async def _find(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)


# ---- inbound ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponsesCall:
    """A validated Responses request and what its answer needs."""

    body: schema.ResponsesRequest
    request: GenerationRequest
    plan: ToolPlan
    id: str
    created_at: int
    model: str
    conversation: tuple[ChatMessage, ...]  # what the next turn replays (no system turns)
    tool_choice: Any  # as echoed
    text: Any  # as echoed


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerFacts:
    """What translation needs from the server: names, bounds, the model's defaults, parsers."""

    base_names: frozenset[str]
    served_name: str
    bounds: RequestBounds
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


def responses_call(
    body: schema.ResponsesRequest, *, request_id: str, facts: ServerFacts, store: ResponseStore
) -> ResponsesCall:
    _check_unsupported(body)
    plan, choice_echo = _plan(body, facts)
    history = store.get(body.previous_response_id).conversation if body.previous_response_id else ()
    given = input_messages(body.input)
    conversation = (*history, *given)
    system = (ChatMessage("system", body.instructions),) if body.instructions is not None else ()
    continues = _continues(body.input)
    prompt = ChatPrompt(
        messages=(*system, *conversation),
        add_generation_prompt=not continues,
        continue_final_message=continues,
        chat_template_kwargs=_template_kwargs(body),
        tools=plan.tools_json,
    )
    parse = facts.reasoning_parser is not None or plan.mode == "auto"
    spec = plan.parse_spec(reasoning=True, template_kwargs=prompt.chat_template_kwargs)
    request = GenerationRequest(
        request_id=request_id,
        model=body.model or "",
        prompt=prompt,
        sampling=_sampling(body, plan, facts),
        output=OutputOptions(logprobs=_output_logprobs(body, facts.bounds)),
        stream=bool(body.stream),
        protocol="openai",
        priority=body.priority,
        parse=spec if parse else None,
    )
    return ResponsesCall(
        body=body,
        request=request,
        plan=plan,
        id=body.request_id or f"resp_{_hex()}",
        created_at=int(time.time()),
        model=response_model(body.model, facts.base_names, facts.served_name),
        conversation=tuple(m for m in conversation if m.role != "system"),
        tool_choice=choice_echo,
        text=body.text.model_dump(by_alias=True) if body.text is not None else None,
    )


OUTPUT_LOGPROBS = "message.output_text.logprobs"


def _output_logprobs(body: schema.ResponsesRequest, bounds: RequestBounds) -> int | None:
    """`include` asks for the output text's logprobs, with `top_logprobs` alternatives each
    (vLLM's `is_include_output_logprobs`); None: not asked."""
    if OUTPUT_LOGPROBS not in (body.include or ()):
        return None
    return bounded_logprobs(body.top_logprobs or 0, bounds, "top_logprobs")


def _check_unsupported(body: schema.ResponsesRequest) -> None:
    refuse_unserved(body.model_extra or {}, unserved.RESPONSES)
    if body.prompt is not None:
        raise InvalidRequest("prompt template is not supported", param="prompt")
    if body.background:
        raise Unsupported(
            "background mode is not supported by this server: send the request without it.",
            param="background",
        )


def _sampling(body: schema.ResponsesRequest, plan: ToolPlan, facts: ServerFacts) -> Sampling:
    cap = facts.bounds.max_new_tokens
    if body.max_output_tokens is not None and cap is not None and body.max_output_tokens > cap:
        raise InvalidRequest(
            f"max_output_tokens must be at most {cap}, got {body.max_output_tokens}.",
            param="max_output_tokens",
        )
    return Sampling(
        max_new_tokens=body.max_output_tokens,
        **vllm_knobs(body, facts.defaults, facts.bounds),
        structured=plan.structured() if plan.forced else _constraint(body),
    )


def _constraint(body: schema.ResponsesRequest) -> StructuredOutput | None:
    """`text.format`, or vLLM's `structured_outputs` (not both, as vLLM)."""
    if body.structured_outputs:
        if body.text is not None and body.text.format is not None:
            raise InvalidRequest(
                "Cannot specify both structured_outputs and text.format",
                param="structured_outputs",
            )
        return vllm_structured(body.structured_outputs)
    return _text_format(body.text)


def _text_format(text: schema.ResponseText | None) -> StructuredOutput | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput(json_object=True)
    if fmt.schema_ is None:
        raise InvalidRequest(
            "text.format of type 'json_schema' needs a `schema`.", param="text.format.schema"
        )
    return StructuredOutput(json_schema=jsonio.dumps(fmt.schema_).decode())


def _template_kwargs(body: schema.ResponsesRequest) -> tuple[tuple[str, Any], ...]:
    effort = body.reasoning.effort if body.reasoning is not None else None
    return with_effort(template_kwargs(body.chat_template_kwargs), effort)


# -- tools --


def _plan(body: schema.ResponsesRequest, facts: ServerFacts) -> tuple[ToolPlan, Any]:
    """The tool plan and the `tool_choice` echo. vLLM's messages; no tools makes "auto" and
    "none" "none". Without a tool-call parser, "auto" renders the tools and answers text."""
    functions = _functions(body.tools)
    parallel = body.parallel_tool_calls is not False
    choice = body.tool_choice
    if isinstance(choice, dict):
        name = _named(choice, functions)
        plan = ToolPlan(mode="named", functions=functions, function=name, parallel=parallel)
        return plan, {"name": name, "type": "function"}
    if choice not in ("none", "auto", "required"):
        raise InvalidRequest(
            f"Invalid value for `tool_choice`: {choice}! Only a function, \"none\", \"auto\" or "
            "\"required\" are supported.",
            param="tool_choice",
        )
    if not functions:
        if choice == "required":
            raise InvalidRequest(
                "Tool choice 'required' must be specified with 'tools' parameter.",
                param="tool_choice",
            )
        return ToolPlan(), "none"
    mode: Mode = "required" if choice == "required" else "none"
    if choice == "auto" and facts.tool_call_parser is not None:
        mode = "auto"
    return ToolPlan(mode=mode, functions=functions, parallel=parallel), choice


def _named(choice: dict[str, Any], functions: Sequence[Function]) -> str:
    kind, name = choice.get("type"), choice.get("name")
    if kind != "function":
        raise Unsupported(
            f"tool_choice of type {str(kind)[:32]!r} is not supported by this server.",
            param="tool_choice",
        )
    if not isinstance(name, str) or name not in {f.name for f in functions}:
        raise InvalidRequest(
            "Tool choice 'function' not found in 'tools' parameter.", param="tool_choice"
        )
    return name


def _functions(given: Sequence[schema.ResponsesTool]) -> tuple[Function, ...]:
    functions = []
    for index, tool in enumerate(given):
        if tool.type != "function":
            raise Unsupported(
                f"Tool type '{tool.type[:32]}' is not supported by this server: only function "
                "tools are.",
                param=f"tools.{index}.type",
            )
        if tool.name is None:
            raise InvalidRequest("A function tool needs a `name`.", param=f"tools.{index}.name")
        check_parameters(tool.parameters, f"tools.{index}.parameters")
        functions.append(
            Function(
                name=tool.name, description=tool.description, parameters=tool.parameters,
                strict=tool.strict,
            )
        )
    return tuple(functions)


# -- input items --


def input_messages(given: str | list[dict[str, Any]]) -> tuple[ChatMessage, ...]:
    """`input` as chat messages: a function call joins the assistant turn before it (or opens
    one), its output is a `tool` turn, reasoning joins the assistant turn."""
    if isinstance(given, str):
        return (ChatMessage("user", given),)
    messages: list[ChatMessage] = []
    for index, item in enumerate(given):
        _add_item(messages, item, index)
    return tuple(messages)


def _add_item(messages: list[ChatMessage], item: dict[str, Any], index: int) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    where = f"input.{index}"
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise InvalidRequest(
                f"Unsupported message role: {str(role)[:32]}", param=f"{where}.role"
            )
        text = _content_text(item.get("content"), f"{where}.content")
        if role == "assistant" and _open_assistant(messages):
            last = messages[-1]
            messages[-1] = replace(last, content=last.content or text)
            return
        messages.append(ChatMessage("system" if role == "developer" else role, text))
    elif kind == "function_call":
        call = ToolCall(
            id=_text_field(item, "call_id", where),
            name=_text_field(item, "name", where),
            arguments=_text_field(item, "arguments", where),
        )
        _join_assistant(messages, lambda m: replace(m, tool_calls=(*m.tool_calls, call)))
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
        messages.append(
            ChatMessage("tool", text, tool_call_id=_text_field(item, "call_id", where))
        )
    elif kind == "reasoning":
        if item.get("encrypted_content"):
            raise Unsupported("Encrypted content is not supported.", param="input")
        text = "".join(str(part.get("text", "")) for part in item.get("content") or ())
        _join_assistant(messages, lambda m: replace(m, reasoning=(m.reasoning or "") + text))
    else:
        raise InvalidRequest(f"Unsupported input item type: {kind}", param=f"{where}.type")


def _open_assistant(messages: list[ChatMessage]) -> bool:
    return bool(messages) and messages[-1].role == "assistant" and not messages[-1].content


def _join_assistant(
    messages: list[ChatMessage], change: Callable[[ChatMessage], ChatMessage]
) -> None:
    if messages and messages[-1].role == "assistant":
        messages[-1] = change(messages[-1])
    else:
        messages.append(change(ChatMessage("assistant", "")))


def _content_text(content: object, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequest("`content` must be a string or a list of parts.", param=param)
    texts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES and kind != "output_text":
            raise Unsupported(
                f"Content part type '{str(kind)[:32]}' is not supported: this model takes text "
                "only.",
                param=f"{param}.{number}",
            )
        texts.append(str(part.get("text") or ""))
    return "".join(texts)


def _text_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"`{key}` must be a string.", param=f"{where}.{key}")
    return value


def _continues(given: str | list[dict[str, Any]]) -> bool:
    """A last item left unfinished continues the final message (vLLM)."""
    if isinstance(given, str) or not given:
        return False
    return given[-1].get("status") in ("in_progress", "incomplete")


# ---- outbound --------------------------------------------------------------------------------


def usage(used: Usage | None) -> JSON | None:
    if used is None:
        return None
    return {
        "input_tokens": used.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": 0, "cache_write_tokens": 0, "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": used.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": used.total_tokens,
    }


def response_object(
    call: ResponsesCall,
    *,
    status: str,
    output: list[JSON],
    used: Usage | None,
    max_output_tokens: int | None,
    incomplete: bool = False,
) -> JSON:
    """vLLM's `ResponsesResponse`, every field in its order."""
    body, sampling = call.body, call.request.sampling
    return {
        "id": call.id,
        "created_at": call.created_at,
        "incomplete_details": INCOMPLETE if incomplete else None,
        "instructions": body.instructions,
        "metadata": body.metadata,
        "model": call.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": sampling.temperature,
        "tool_choice": call.tool_choice,
        "tools": [_tool_echo(f) for f in call.plan.functions],
        "top_p": 1.0 if sampling.temperature == 0 else sampling.top_p,
        "background": False,
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "previous_response_id": body.previous_response_id,
        "prompt": None,
        "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
        "service_tier": body.service_tier or "auto",
        "status": status,
        "text": call.text,
        "top_logprobs": call.request.output.logprobs,
        "truncation": body.truncation or "disabled",
        "usage": usage(used),
        "user": body.user,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def _tool_echo(function: Function) -> JSON:
    return {
        "name": function.name, "parameters": function.parameters, "strict": function.strict,
        "type": "function", "allowed_callers": None, "async": None, "defer_loading": None,
        "description": function.description, "output_schema": None,
    }


def message_item(
    item_id: str, text: str, status: str = "completed", logprobs: list[JSON] | None = None
) -> JSON:
    content = [_text_part(text, logprobs)] if status == "completed" else []
    return {
        "id": item_id, "content": content, "role": "assistant", "status": status,
        "type": "message", "phase": None,
    }


def _text_part(text: str, logprobs: list[Any] | None = None) -> JSON:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def call_item(item_id: str, piece: ToolCallPiece, arguments: str, status: str) -> JSON:
    return {
        "arguments": arguments, "call_id": piece.id, "name": piece.name, "type": "function_call",
        "id": item_id, "async": None, "caller": None, "namespace": None, "status": status,
    }


def reasoning_item(item_id: str, text: str | None) -> JSON:
    content = [{"text": text, "type": "reasoning_text"}] if text is not None else None
    return {
        "id": item_id, "summary": [], "type": "reasoning", "content": content,
        "encrypted_content": None, "status": None,
    }


def output_items(parsed: ParsedOutput, logprobs: list[JSON] | None = None) -> list[JSON]:
    """A whole answer's items: reasoning, then the message (when it has text, with the whole
    choice's `logprobs`, as vLLM), then calls."""
    items = []
    if parsed.reasoning:
        items.append(reasoning_item(f"rs_{_hex()}", parsed.reasoning))
    if parsed.content:
        items.append(message_item(f"msg_{_hex()}", parsed.content, logprobs=logprobs))
    items += [call_item(f"fc_{_hex()}", p, p.arguments, "completed") for p in parsed.tool_calls]
    return items


def final_response(call: ResponsesCall, result: GenerationResult, reader: ChoiceReader) -> JSON:
    """`max_output_tokens` echoes the limit the engine's prompt budget set, as vLLM echoes its
    `SamplingParams.max_tokens` (the request's, or the model's default, within the room)."""
    choice = result.choices[0]
    parsed = reader.whole(choice.text, choice.token_ids, result.prompt.prompt_token_ids)
    incomplete = choice.finish_reason.value == "length"
    asked = call.request.output.logprobs is not None
    logprobs = [chat_logprob(lp) for lp in choice.logprobs] if asked else None
    return response_object(
        call,
        status="incomplete" if incomplete else "completed",
        output=output_items(parsed, logprobs),
        used=result.usage,
        max_output_tokens=result.prompt.max_tokens,
        incomplete=incomplete,
    )


def stored(call: ResponsesCall, response: JSON) -> Stored:
    """The conversation the next turn replays: this one's, then the answer as an assistant
    turn with its reasoning and calls (vLLM drops the calls)."""
    text, reasoning, calls = "", None, []
    for item in response["output"]:
        if item["type"] == "message":
            text += "".join(part["text"] for part in item["content"])
        elif item["type"] == "reasoning":
            reasoning = "".join(part["text"] for part in item["content"] or ())
        elif item["type"] == "function_call":
            calls.append(
                ToolCall(id=item["call_id"], name=item["name"], arguments=item["arguments"])
            )
    answer = ChatMessage("assistant", text, tool_calls=tuple(calls), reasoning=reasoning)
    return Stored(response=response, conversation=(*call.conversation, answer))


# ---- streaming --------------------------------------------------------------------------------


class _Item:
    """The output item being streamed."""

    def __init__(self, kind: str, item_id: str, index: int, piece: ToolCallPiece | None = None):
        self.kind = kind
        self.id = item_id
        self.index = index
        self.piece = piece
        self.text = ""
        self.logprobs: list[JSON] = []  # a message's, when asked for


class ResponseEvents:
    """Events → the Responses SSE stream: `event: <type>` and `data: <event>` per event, every
    event numbered; items open and close as the answer moves from reasoning to text to calls."""

    def __init__(
        self,
        call: ResponsesCall,
        parser: OutputParser | None,
        *,
        on_complete: Callable[[JSON], None],
    ) -> None:
        self._call = call
        parsed = call.request.parse is not None or call.plan.forced
        self._reader = ChoiceReader(call.plan, parser) if parsed else None
        self._on_complete = on_complete
        self._sequence = 0
        self._output: list[JSON] = []
        self._item: _Item | None = None
        self._max_tokens: int | None = None
        self._prompt_ids: tuple[int, ...] | None = None
        self._finish = "stop"
        self._unsent: list[TokenLogprob] = []  # logprobs of tokens whose text is not out yet

    # -- StreamFormat --

    def encode(self, event: GenerationEvent) -> bytes:
        if isinstance(event, Started):
            self._prompt_ids = event.prompt_token_ids
            self._max_tokens = event.max_tokens
            return self._opening()
        if isinstance(event, Delta):
            return self._delta(event)
        return self._completed(event)

    def error(self, exc: GatewayError) -> bytes:
        """OpenAI's `error` event (vLLM 0.32 fails to build one and breaks the stream)."""
        _, kind = status_and_type(exc)
        return self._event("error", {"code": kind, "message": exc.message, "param": exc.param})

    def end(self) -> bytes:
        return b""

    # -- the parts --

    def _opening(self) -> bytes:
        response = self._response("in_progress", used=None)
        return self._event("response.created", {"response": response}) + self._event(
            "response.in_progress", {"response": response}
        )

    def _delta(self, delta: Delta) -> bytes:
        finished = delta.finish is not None
        if finished:
            assert delta.finish is not None
            self._finish = delta.finish.value
        parsed = self._parse(delta, finished)
        self._unsent += delta.logprobs
        out = b""
        if parsed is not None:
            if parsed.reasoning:
                out += self._text("reasoning", parsed.reasoning)
            if parsed.content:
                out += self._text("message", parsed.content, self._unsent)
                self._unsent = []
            for piece in parsed.tool_calls:
                out += self._call_piece(piece)
        return out

    def _parse(self, delta: Delta, finished: bool) -> ParsedOutput | None:
        if self._reader is None:
            return ParsedOutput(content=delta.text) if delta.text else None
        first, self._prompt_ids = self._prompt_ids, None
        return self._reader.piece(
            delta.text, delta.token_ids, prompt_token_ids=first, finished=finished
        )

    def _text(self, kind: str, text: str, logprobs: Sequence[TokenLogprob] = ()) -> bytes:
        out = b""
        if self._item is None or self._item.kind != kind:
            out += self._close() + self._open(kind)
        item = self._item
        assert item is not None
        item.text += text
        name = f"response.{'reasoning_text' if kind == 'reasoning' else 'output_text'}.delta"
        fields: JSON = {"content_index": 0, "delta": text, "item_id": item.id}
        if kind == "message":
            fields["logprobs"] = self._logprobs(item, logprobs)
        fields["output_index"] = item.index
        return out + self._event(name, fields)

    def _logprobs(self, item: _Item, logprobs: Sequence[TokenLogprob]) -> list[JSON]:
        """A text delta's logprobs as the delta event carries them (no bytes), when asked;
        the item keeps them whole for its part. Tokens whose text was held back (an unfinished
        character, a parser's look-ahead) go out with the next text, so the stream carries
        the whole answer's logprobs, as the non-streamed part does."""
        if self._call.request.output.logprobs is None:
            return []
        whole = [chat_logprob(lp) for lp in logprobs]
        item.logprobs += whole
        return [_without_bytes(entry) for entry in whole]

    def _call_piece(self, piece: ToolCallPiece) -> bytes:
        out = b""
        item = self._item
        if piece.id is not None or item is None or item.kind != "function_call":
            out += self._close() + self._open("function_call", piece)
            item = self._item
        assert item is not None
        if not piece.arguments:
            return out
        item.text += piece.arguments
        return out + self._event(
            "response.function_call_arguments.delta",
            {"delta": piece.arguments, "item_id": item.id, "output_index": item.index},
        )

    def _open(self, kind: str, piece: ToolCallPiece | None = None) -> bytes:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = self._item = _Item(kind, f"{prefix}_{_hex()}", len(self._output), piece)
        self._output.append({})  # its place; filled when the item closes
        out = self._event(
            "response.output_item.added",
            {"item": self._item_body(item, "in_progress"), "output_index": item.index},
        )
        if kind == "function_call":
            return out
        part = (
            {"text": "", "type": "reasoning_text"} if kind == "reasoning" else _text_part("", [])
        )
        return out + self._event(
            "response.content_part.added",
            {"content_index": 0, "item_id": item.id, "output_index": item.index, "part": part},
        )

    def _close(self) -> bytes:
        item, self._item = self._item, None
        if item is None:
            return b""
        done = self._item_body(item, "completed")
        self._output[item.index] = done
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            assert item.piece is not None
            out = self._event(
                "response.function_call_arguments.done",
                {"arguments": item.text, **where},
                tail={"name": item.piece.name},  # vLLM adds it last (not in the SDK's type)
            )
        elif item.kind == "reasoning":
            part = {"text": item.text, "type": "reasoning_text"}
            out = self._event(
                "response.reasoning_text.done", {"content_index": 0, **where, "text": item.text}
            ) + self._event(
                "response.content_part.done", {"content_index": 0, **where, "part": part}
            )
        else:
            out = self._event(
                "response.output_text.done",
                {"content_index": 0, **where, "logprobs": [], "text": item.text},
            ) + self._event(
                "response.content_part.done",
                {"content_index": 0, **where, "part": _text_part(item.text, item.logprobs or None)},
            )
        return out + self._event(
            "response.output_item.done", {"item": done, "output_index": item.index}
        )

    def _item_body(self, item: _Item, status: str) -> JSON:
        if item.kind == "function_call":
            assert item.piece is not None
            return call_item(item.id, item.piece, item.text, status)
        if item.kind == "reasoning":
            return reasoning_item(item.id, item.text if status == "completed" else None)
        return message_item(item.id, item.text, status, item.logprobs or None)

    def _completed(self, done: Done) -> bytes:
        out = self._close()
        incomplete = self._finish == "length"
        response = self._response(
            "incomplete" if incomplete else "completed", used=done.usage, incomplete=incomplete
        )
        self._on_complete(response)
        return out + self._event("response.completed", {"response": response})

    def _response(self, status: str, *, used: Usage | None, incomplete: bool = False) -> JSON:
        return response_object(
            self._call,
            status=status,
            output=[item for item in self._output if item],
            used=used,
            max_output_tokens=self._max_tokens,
            incomplete=incomplete,
        )

    def _event(self, kind: str, fields: JSON, tail: JSON | None = None) -> bytes:
        payload = {**fields, "sequence_number": self._sequence, "type": kind, **(tail or {})}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + jsonio.dumps(payload) + b"\n\n"


def _without_bytes(entry: JSON) -> JSON:
    """`response.output_text.delta`'s logprob: the text part's `entry`, without the bytes."""
    return {
        "token": entry["token"],
        "logprob": entry["logprob"],
        "top_logprobs": [
            {"token": top["token"], "logprob": top["logprob"]} for top in entry["top_logprobs"]
        ],
    }
