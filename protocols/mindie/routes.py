"""MindIE native routes: POST /infer, /infer_token and /v1/tokenizer, and the vLLM flavour of
MindIE's dual `/generate` (bodies with `prompt`; others go to TGI's `/generate`).

A request's `id` (or X-Request-Id) is its request id, so `stopInfer` can cancel it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request

from protocols.common.sse import TokenEventStream
from protocols.mindie import errors, schema, translate
from protocols.mindie.schema import InferRequest, VllmGenerateRequest
from server.core.errors import GatewayError, InvalidRequest
from server.core.types import Delta, GenerationEvent
from server.http import jsonio
from server.http.body import json_response, parse_model, read_body, request_id_header
from server.http.context import ProtocolContext, current_request_id
from server.http.disconnect import until_disconnect
from server.http.router import has_key
from server.http.routes import Answer, Doc, Endpoint, Route, RouteList
from server.http.streaming import EventStreamAnswer

NAME = "mindie"
STREAM_TYPE = "text/event-stream"  # MindIE sends every stream with this type, NUL chunks included


async def _json_body(ctx: ProtocolContext, request: Request, message: str) -> dict[str, Any]:
    body = await read_body(request, ctx.max_body_bytes)
    try:
        data = jsonio.loads(body) if body.strip() else None
    except jsonio.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise InvalidRequest(message)
    return data


class _InferEvents(TokenEventStream):
    """`/infer` streams: SSE events, one per token, timed; errors as MindIE's error event."""

    def __init__(
        self, plan: translate.InferPlan, started_at: float,
        token_texts: Callable[[list[int]], list[str]],
    ) -> None:
        super().__init__(errors.stream_error)
        self._encoder = translate.InferStreamEncoder(
            plan, started_at=started_at, token_texts=token_texts
        )
        self._now = started_at

    def encode(self, event: GenerationEvent) -> bytes:
        if type(event) is Delta:
            self._now = now = time.perf_counter()  # the delta's time, for `events` too
            frame = self._encoder.plain_frame(event, now, b"data: ", b"\n\n")
            return self.general(event) if frame is None else frame
        return super().encode(event)

    def events(self, delta: Delta) -> list[dict[str, Any]]:
        return self._encoder.events(delta, self._now)


class _VllmChunks:
    """MindIE's vLLM `/generate` stream: `{"text": [...]}` chunks each followed by a NUL byte."""

    def __init__(self, n: int) -> None:
        self._n = n

    def encode(self, event: GenerationEvent) -> bytes:
        if isinstance(event, Delta) and event.text:
            return jsonio.dumps(translate.vllm_chunk(event, self._n)) + b"\0"
        return b""

    def error(self, exc: GatewayError) -> bytes:
        return errors.chunk_error(exc)

    def end(self) -> bytes:
        return b""


def infer(ctx: ProtocolContext) -> Endpoint:
    """`/infer` and `/infer_token`: text `inputs` or token `input_id`, streamed or not."""
    service = ctx.service

    async def endpoint(request: Request) -> Answer:
        started_at = time.perf_counter()
        data = await _json_body(ctx, request, "Failed to parse request context to json")
        prompt = translate.infer_prompt(data)
        body = parse_model(InferRequest, data)
        request_id = body.id or request_id_header(request) or current_request_id()
        plan = translate.infer_request(
            body, prompt, request_id=request_id, defaults=service.defaults()
        )
        if plan.request.stream:
            events = await service.start(plan.request)
            fmt = _InferEvents(plan, started_at, service.token_texts)
            return EventStreamAnswer(events, fmt, media_type=STREAM_TYPE)
        result = await until_disconnect(request, service.generate(plan.request))
        return json_response(translate.to_infer_response(result, plan))

    return endpoint


def vllm_generate(ctx: ProtocolContext) -> Endpoint:
    """MindIE `/generate` with `prompt`: `{"text": ["<prompt> <completion>"]}`, or a stream of
    `{"text": ["<delta>"]}` chunks each followed by a NUL byte."""
    service = ctx.service

    async def endpoint(request: Request) -> Answer:
        data = await _json_body(ctx, request, "Failed to parse request context to json")
        body = parse_model(VllmGenerateRequest, data)
        request_id = request_id_header(request) or current_request_id()
        plan = translate.vllm_request(
            body, request_id=request_id, bounds=ctx.bounds, vocab_size=service.info().vocab_size,
            defaults=service.defaults(),
        )
        if plan.request.stream:
            events = await service.start(plan.request)
            fmt = _VllmChunks(plan.request.sampling.n)
            return EventStreamAnswer(events, fmt, media_type=STREAM_TYPE)
        result = await until_disconnect(request, service.generate(plan.request))
        return json_response(translate.to_vllm_response(result, plan))

    return endpoint


def tokenizer(ctx: ProtocolContext) -> Endpoint:
    """`/v1/tokenizer`: `{"token_number": n, "tokens": [text of each token]}`."""
    service = ctx.service

    async def endpoint(request: Request) -> Answer:
        data = await _json_body(ctx, request, "Req body converts to json fail.")
        inputs, do_decode = data.get("inputs"), data.get("do_decode")
        if not isinstance(inputs, str):
            raise InvalidRequest("Inputs in request body is invalid.", param="inputs")
        if not inputs:
            raise InvalidRequest(
                f"Inputs data length in [0, {ctx.max_body_bytes}], but the length of inputs is 0",
                param="inputs",
            )
        token_ids = await service.tokenize(inputs, add_special_tokens=True)
        texts = service.token_texts(token_ids) if do_decode is not False else []
        return json_response(translate.to_tokenizer_response(token_ids, texts))

    return endpoint


def routes(ctx: ProtocolContext) -> list[Route]:
    out = RouteList(owner=NAME, render=errors.render)
    handler = infer(ctx)
    out.post("/infer", handler,
             doc=Doc(summary="Inference on text", body=schema.INFER_BODY, streams=True))
    out.post("/infer_token", handler,
             doc=Doc(summary="Inference on token ids", body=schema.INFER_TOKEN_BODY,
                     streams=True))
    out.post("/v1/tokenizer", tokenizer(ctx),
             doc=Doc(summary="Tokenize", body=schema.TOKENIZER_BODY))
    out.post("/generate", vllm_generate(ctx), claim=has_key("prompt"),
             doc=Doc(summary="MindIE's vLLM flavour (`prompt`)", body=VllmGenerateRequest,
                     streams=True))
    return out.routes
