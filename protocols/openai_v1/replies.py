"""What chat and completion replies share: the meta every body and chunk repeats, usage,
the logprob floor, prompt logprobs and the SSE chunk writer.

Non-streamed bodies carry every field vLLM dumps (nulls included); stream chunks carry only the
fields vLLM sets. Stream chunks are plain dicts serialised by `jsonio` (no pydantic per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocols.openai_v1 import schema
from server.core.frozen import quick_init
from server.core.types import Started, Usage
from server.http import jsonio
from server.http.streaming import sse_event

JSON = dict[str, Any]

MIN_LOGPROB = -9999.0  # vLLM clamps -inf to this so the JSON stays valid


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class ReplyMeta:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str
    fingerprint: str | None = None  # `system_fingerprint` of whole answers and last chunks
    fingerprint_each_chunk: bool = False  # TGI's placement: on every chunk


@quick_init
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


def stream_usage(prompt_tokens: int, completion_tokens: int) -> JSON:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


_TEXT_ONLY_TAIL = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'


class ChunkWriter:
    """Stream chunks share `id`, `object`, `created`, `model`: serialise that head once. The
    fingerprint goes where each server puts it: for model "tgi" on every chunk after `model`, as
    TGI's router writes its chunks; otherwise only on the stream's last message (`chunk(last=
    True)`), as vLLM 0.32 stamps it."""

    def __init__(self, meta: ReplyMeta, obj: str) -> None:
        fields: JSON = {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model}
        self._closing: JSON = {}
        if meta.fingerprint is not None and meta.fingerprint_each_chunk:
            fields["system_fingerprint"] = meta.fingerprint
        elif meta.fingerprint is not None:
            self._closing = {"system_fingerprint": meta.fingerprint}
        head = jsonio.dumps(fields)
        self._prefix = head[:-1] + b',"choices":['
        self._text_heads: dict[int, bytes] = {}  # per choice: the SSE event up to its text

    def text_chunk(self, index: int, text: str) -> bytes:
        """`chunk()` of a chat choice that carries only text: most chunks of a stream, written
        without building and serialising a dict (the same bytes)."""
        head = self._text_heads.get(index)
        if head is None:
            head = self._text_heads[index] = b"".join((
                b"data: ", self._prefix, b'{"index":', str(index).encode(),
                b',"delta":{"content":',
            ))
        return b"".join((head, jsonio.dumps_scalar(text), _TEXT_ONLY_TAIL))

    def chunk(
        self, choice: JSON | None, usage: JSON | None = None, *, last: bool = False,
        **extra: Any,
    ) -> bytes:
        """One chunk; `last`: the stream's last message, vLLM's way (a choice's finishing
        chunk when no usage chunk follows, or the usage chunk), which carries the fingerprint
        after `usage`."""
        parts = [self._prefix, b"" if choice is None else jsonio.dumps(choice), b"]"]
        if usage is not None:
            parts += [b',"usage":', jsonio.dumps(usage)]
        if last:
            extra = {**self._closing, **extra}
        for key, value in extra.items():
            parts += [b',"', key.encode(), b'":', jsonio.dumps(value)]
        parts.append(b"}")
        return sse_event(b"".join(parts))


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
    return {"logprob": clamp_logprob(logprob), "rank": rank, "decoded_token": token}
