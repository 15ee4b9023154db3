"""`GenerationResult` and events → chat completion bodies and `chat.completion.chunk` SSE bytes
as vLLM 0.32 writes them (PROTOCOLS.md §2.1), rendered through one `ChatView` per request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from protocols.common.tools import ChoiceReader, ToolPlan, finish_reason
from protocols.openai_v1 import schema
from protocols.openai_v1.replies import (
    ChunkWriter,
    ReplyMeta,
    StreamUsage,
    clamp_logprob,
    prompt_logprobs_json,
    stream_usage,
    usage_dict,
)
from protocols.openai_v1.requests import message_text
from server.core.engine import OutputParser
from server.core.frozen import quick_init
from server.core.types import (
    Choice,
    Delta,
    Done,
    GenerationEvent,
    GenerationResult,
    ParsedOutput,
    Started,
    TokenLogprob,
    ToolCallPiece,
)

JSON = dict[str, Any]


def _no_parser() -> OutputParser | None:
    return None


@quick_init
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
            echo = message_text(last, len(body.messages) - 1)
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
        "logprob": clamp_logprob(lp.logprob),
        "bytes": list(lp.token.encode()),
        "top_logprobs": [
            {"token": t.token, "logprob": clamp_logprob(t.logprob), "bytes": list(t.token.encode())}
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
        "system_fingerprint": view.meta.fingerprint,
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
        self._out = ChunkWriter(view.meta, "chat.completion.chunk")
        self._prompt_tokens = 0
        self._prompt_ids: tuple[int, ...] = ()
        self._generated = [0] * view.n
        # chunks that carry only text: no logprobs, token ids or per-chunk usage asked for
        self._plain = not (view.logprobs or view.return_token_ids or view.usage.continuous)
        self._readers = [view.reader() for _ in range(view.n)] if view.parsed else []
        self._fed: set[int] = set()  # choices whose reader has had its first piece
        self._text_only = self._plain and not self._readers

    def encode(self, event: GenerationEvent) -> bytes:
        if isinstance(event, Delta):
            if self._text_only and event.finish is None and event.token_ids:  # most chunks
                i = event.choice
                self._generated[i] += len(event.token_ids)
                return self._out.text_chunk(i, event.text)
            return self._output(event)
        if isinstance(event, Started):
            return self._start(event)
        return self._done(event)

    def _usage(self, choice: int) -> JSON | None:
        if not self._view.usage.continuous:
            return None
        usage = stream_usage(self._prompt_tokens, self._generated[choice])
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
        last = event.finish is not None and not view.usage.include
        return self._out.chunk(choice, self._usage(i), last=last)

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
        return out + self._out.chunk(choice, self._usage(i), last=not view.usage.include)

    def _done(self, event: Done) -> bytes:
        if not self._view.usage.include:
            return b""
        usage = event.usage
        totals = stream_usage(usage.prompt_tokens, usage.completion_tokens)
        return self._out.chunk(None, totals, last=True)


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
