"""One client per protocol: how to ask for N tokens, and how to read tokens back (stream or not).

Shapes follow /work/shared/PROTOCOLS.md (the same shapes the gateway's routes implement):

- openai-chat / openai-completions: `/v1/chat/completions`, `/v1/completions`, SSE with `data: `
  and a final usage chunk (`stream_options.include_usage`), `ignore_eos` as vLLM's extra field;
- tgi: `/generate_stream` (one SSE event per token) and `/generate` (`details` for the count);
- triton: `/v2/models/{m}/generate_stream` and `/generate` (`text_output` deltas);
- mindie: `/infer` (native, SSE with `token` events, `details.generated_tokens`);
- djl: `/invocations` with `inputs` (JSON lines `{"token": ...}` when streaming);
- anthropic: `/v1/messages` (named SSE events: `content_block_delta` per step, usage in
  `message_delta`, `message_stop` last). The Messages API has no `ignore_eos`: both arms answer
  the same greedy tokens, and the counts come from `usage`.

Timing follows vLLM's serving benchmark (a "text event" is a streamed event for one engine step),
except for chat: vLLM's chat client stops the TTFT clock at the first chunk with `choices`, which
is the role-only opening chunk; a server may send that before any token exists, so here it does
not count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class Ask:
    """What one request asks for."""

    prompt: str
    max_tokens: int
    stream: bool
    model: str  # served base name or an adapter name
    base: str  # served base name (adapter selectors need to know "base")
    ignore_eos: bool = True
    extra: tuple[tuple[str, Any], ...] = ()  # more body fields (OpenAI routes)


@dataclass(frozen=True, slots=True)
class Event:
    """What one streamed event (or a whole non-streamed body) says."""

    text: bool  # carries generated text (a token)
    tokens: int | None = None  # authoritative completion-token count, when the event has one
    prompt_tokens: int | None = None
    error: str | None = None
    final: bool = False  # nothing follows (the [DONE] marker)


NOTHING = Event(text=False)
DONE = Event(text=False, final=True)


@dataclass(frozen=True, slots=True)
class Protocol:
    name: str
    path: Callable[[Ask], str]
    body: Callable[[Ask], dict[str, Any]]
    delimiter: bytes  # what ends one streamed event
    event: Callable[[bytes], Event]  # one streamed event (delimiter removed)
    whole: Callable[[bytes], Event]  # a non-streamed body
    counts_events: bool  # stream has no usage: one text event = one token
    headers: Callable[[Ask], dict[str, str]] | None = None

    def encode(self, ask: Ask) -> bytes:
        return orjson.dumps(self.body(ask))


def _sse_payload(raw: bytes) -> bytes | None:
    """The `data:` payload of one SSE event (comments and other fields dropped)."""
    for line in raw.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].lstrip(b" ")
    return None


def _sse(parse: Callable[[Any], Event]) -> Callable[[bytes], Event]:
    def event(raw: bytes) -> Event:
        payload = _sse_payload(raw)
        if payload is None:
            return NOTHING
        if payload == b"[DONE]":
            return DONE
        data = orjson.loads(payload)
        if isinstance(data, dict) and "error" in data:
            return Event(text=False, error=str(data["error"])[:200], final=True)
        return parse(data)

    return event


def _json(parse: Callable[[Any], Event]) -> Callable[[bytes], Event]:
    def event(raw: bytes) -> Event:
        raw = raw.strip(b"\0 \r\n")
        if not raw:
            return NOTHING
        data = orjson.loads(raw)
        if isinstance(data, dict) and "error" in data:
            return Event(text=False, error=str(data["error"])[:200], final=True)
        return parse(data)

    return event


# -- OpenAI (vLLM flavour) ---------------------------------------------------------------


def _openai_common(ask: Ask) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": ask.model,
        "max_tokens": ask.max_tokens,
        "temperature": 0.0,
        "stream": ask.stream,
    }
    if ask.ignore_eos:
        body["ignore_eos"] = True
    if ask.stream:
        body["stream_options"] = {"include_usage": True}
    body.update(ask.extra)
    return body


def _usage_event(data: dict[str, Any]) -> Event:
    usage = data.get("usage") or {}
    return Event(
        text=False,
        tokens=usage.get("completion_tokens"),
        prompt_tokens=usage.get("prompt_tokens"),
    )


def _chat_chunk(data: dict[str, Any]) -> Event:
    # Every chunk with choices is a token step, as in vLLM's client, except the role-only
    # opening chunk, which a server may send before any token exists.
    choices = data.get("choices")
    if not choices:
        return _usage_event(data)
    delta = choices[0].get("delta") or {}
    return Event(text=bool(delta.get("content")) or "role" not in delta)


def _completion_chunk(data: dict[str, Any]) -> Event:
    # As vLLM's client: a chunk with choices is a token step even when its text is empty
    # (a held-back partial UTF-8 sequence, a skipped special token).
    choices = data.get("choices")
    if not choices:
        return _usage_event(data)
    return Event(text=True)


def _openai_whole(data: dict[str, Any]) -> Event:
    usage = data.get("usage") or {}
    return Event(
        text=True,
        tokens=usage.get("completion_tokens"),
        prompt_tokens=usage.get("prompt_tokens"),
        final=True,
    )


OPENAI_CHAT = Protocol(
    name="openai-chat",
    path=lambda ask: "/v1/chat/completions",
    body=lambda ask: {
        **_openai_common(ask),
        "messages": [{"role": "user", "content": ask.prompt}],
    },
    delimiter=b"\n\n",
    event=_sse(_chat_chunk),
    whole=_json(_openai_whole),
    counts_events=False,
)

OPENAI_COMPLETIONS = Protocol(
    name="openai-completions",
    path=lambda ask: "/v1/completions",
    body=lambda ask: {**_openai_common(ask), "prompt": ask.prompt},
    delimiter=b"\n\n",
    event=_sse(_completion_chunk),
    whole=_json(_openai_whole),
    counts_events=False,
)


# -- TGI -----------------------------------------------------------------------------------


def _tgi_body(ask: Ask) -> dict[str, Any]:
    parameters: dict[str, Any] = {
        "max_new_tokens": ask.max_tokens,
        "do_sample": False,
        "details": True,
    }
    if ask.model != ask.base:
        parameters["adapter_id"] = ask.model
    return {"inputs": ask.prompt, "parameters": parameters}


def _tgi_event(data: dict[str, Any]) -> Event:
    token = data.get("token") or {}
    details = data.get("details") or {}
    return Event(
        text=not token.get("special", False),
        tokens=details.get("generated_tokens"),
        final=data.get("generated_text") is not None,
    )


def _tgi_whole(data: Any) -> Event:
    if isinstance(data, list):  # POST / answers a one-element list
        data = data[0]
    details = data.get("details") or {}
    return Event(
        text=True,
        tokens=details.get("generated_tokens"),
        prompt_tokens=details.get("prompt_tokens"),
        final=True,
    )


TGI = Protocol(
    name="tgi",
    path=lambda ask: "/generate_stream" if ask.stream else "/generate",
    body=_tgi_body,
    delimiter=b"\n\n",
    event=_sse(_tgi_event),
    whole=_json(_tgi_whole),
    counts_events=True,
)


# -- Triton / KServe v2 generate extension --------------------------------------------------


def _triton_body(ask: Ask) -> dict[str, Any]:
    parameters: dict[str, Any] = {
        "max_tokens": ask.max_tokens,
        "temperature": 0.0,
        "stream": ask.stream,
    }
    if ask.ignore_eos:
        parameters["ignore_eos"] = True
    if ask.model != ask.base:
        parameters["lora_name"] = ask.model
    body: dict[str, Any] = {"text_input": ask.prompt, "parameters": parameters}
    if not ask.stream:  # top-level keys are input tensors of the generate extension
        body.update(exclude_input_in_output=True, return_num_output_tokens=True)
    return body


def _triton_event(data: dict[str, Any]) -> Event:
    return Event(text=bool(data.get("text_output")), final=data.get("done") is True)


def _triton_whole(data: dict[str, Any]) -> Event:
    tokens = data.get("num_output_tokens")
    if isinstance(tokens, list):  # a tensor of one element may come back as a list
        tokens = tokens[0] if tokens else None
    return Event(text=True, tokens=tokens, final=True)


TRITON = Protocol(
    name="triton",
    path=lambda ask: f"/v2/models/{ask.base}/generate{'_stream' if ask.stream else ''}",
    body=_triton_body,
    delimiter=b"\n\n",
    event=_sse(_triton_event),
    whole=_json(_triton_whole),
    counts_events=True,
)


# -- MindIE native --------------------------------------------------------------------------


def _mindie_body(ask: Ask) -> dict[str, Any]:
    return {
        "inputs": ask.prompt,
        "stream": ask.stream,
        "parameters": {"max_new_tokens": ask.max_tokens, "do_sample": False, "details": True},
    }


def _mindie_event(data: dict[str, Any]) -> Event:
    # Every event is one token; the last one carries `text: null` and the full text instead.
    details = data.get("details") or {}
    return Event(
        text=bool(data.get("token")),
        tokens=details.get("generated_tokens"),
        final=data.get("generated_text") is not None,
    )


def _details_whole(data: dict[str, Any]) -> Event:
    details = data.get("details") or {}
    return Event(text=True, tokens=details.get("generated_tokens"), final=True)


MINDIE = Protocol(
    name="mindie",
    path=lambda ask: "/infer",
    body=_mindie_body,
    delimiter=b"\n\n",
    event=_sse(_mindie_event),
    whole=_json(_details_whole),
    counts_events=True,
)


# -- DJL / SageMaker LMI --------------------------------------------------------------------


def _djl_body(ask: Ask) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": ask.prompt,
        "stream": ask.stream,
        "parameters": {"max_new_tokens": ask.max_tokens, "do_sample": False, "details": True},
    }
    if ask.ignore_eos:
        body["parameters"]["ignore_eos_token"] = True
    if ask.model != ask.base:
        body["adapters"] = ask.model
    return body


def _djl_event(data: dict[str, Any]) -> Event:
    token = data.get("token") or {}
    details = data.get("details") or {}
    return Event(
        text=bool(token.get("text")),
        tokens=details.get("generated_tokens"),
        final=data.get("generated_text") is not None,
    )


DJL = Protocol(
    name="djl",
    path=lambda ask: "/invocations",
    body=_djl_body,
    delimiter=b"\n",
    event=_json(_djl_event),
    whole=_json(_details_whole),
    counts_events=True,
)


# -- Anthropic Messages ------------------------------------------------------------------------


def _anthropic_body(ask: Ask) -> dict[str, Any]:
    return {
        "model": ask.model,
        "max_tokens": ask.max_tokens,
        "temperature": 0.0,
        "stream": ask.stream,
        "messages": [{"role": "user", "content": ask.prompt}],
    }


def _anthropic_event(data: dict[str, Any]) -> Event:
    kind = data.get("type")
    if kind == "content_block_delta":
        return Event(text=True)
    if kind == "message_start":
        usage = (data.get("message") or {}).get("usage") or {}
        return Event(text=False, prompt_tokens=usage.get("input_tokens"))
    if kind == "message_delta":
        usage = data.get("usage") or {}
        return Event(text=False, tokens=usage.get("output_tokens"))
    return DONE if kind == "message_stop" else NOTHING


def _anthropic_whole(data: dict[str, Any]) -> Event:
    usage = data.get("usage") or {}
    return Event(
        text=True,
        tokens=usage.get("output_tokens"),
        prompt_tokens=usage.get("input_tokens"),
        final=True,
    )


ANTHROPIC = Protocol(
    name="anthropic",
    path=lambda ask: "/v1/messages",
    body=_anthropic_body,
    delimiter=b"\n\n",
    event=_sse(_anthropic_event),
    whole=_json(_anthropic_whole),
    counts_events=False,
)


PROTOCOLS: dict[str, Protocol] = {
    p.name: p for p in (OPENAI_CHAT, OPENAI_COMPLETIONS, TGI, TRITON, MINDIE, DJL, ANTHROPIC)
}
