"""MindIE native routes: POST /infer, /infer_token and /v1/tokenizer.

`vllm_generate` (the vLLM flavour of MindIE's dual `/generate`, for bodies with `prompt`) is
exported for the gateway's body dispatch; the `/generate` route is mounted there, not here.
A request's `id` (or X-Request-Id) is its request id, so `stopInfer` can cancel it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from protocols._common import jsonio
from protocols._common.context import ProtocolContext
from protocols._common.disconnect import while_connected
from protocols._common.guard import Endpoint, guarded
from protocols._common.http import json_response, parse_model, read_body, request_id_header
from protocols._common.lookahead import EndCandidates, with_ends
from protocols._common.streaming import StreamResponse, sse_event
from protocols.mindie import errors, translate
from protocols.mindie.schema import InferRequest, VllmGenerateRequest
from server.core.errors import EngineError, GatewayError, InvalidRequest
from server.core.service import EventStream
from server.core.types import ChoiceEnd, Delta

logger = logging.getLogger("gateway.protocols.mindie")
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


def _streaming(chunks: AsyncIterator[bytes]) -> Response:
    # StreamResponse is a plain ASGI response, which Starlette's endpoints may return.
    return cast(Response, StreamResponse(chunks, media_type=STREAM_TYPE))


def infer(ctx: ProtocolContext) -> Endpoint:
    """`/infer` and `/infer_token`: text `inputs` or token `input_id`, streamed or not."""

    @guarded(errors.render)
    async def endpoint(request: Request) -> Response:
        started_at = time.perf_counter()
        data = await _json_body(ctx, request, "Failed to parse request context to json")
        prompt = translate.infer_prompt(data)
        body = parse_model(InferRequest, data)
        request_id = body.id or request_id_header(request) or uuid.uuid4().hex
        plan = translate.infer_request(body, prompt, request_id=request_id)
        if plan.request.stream:
            events = await ctx.service.start(plan.request)
            engine = ctx.service.engine
            return _streaming(
                _infer_events(
                    events, plan, started_at, engine.token_texts, engine.info().eos_token_id
                )
            )
        result = await while_connected(request, ctx.service.generate(plan.request))
        return json_response(translate.to_infer_response(result, plan))

    return endpoint


def _infer_events(
    events: EventStream,
    plan: translate.InferPlan,
    started_at: float,
    token_texts: Callable[[list[int]], list[str]],
    eos_token_id: int | None,
) -> AsyncIterator[bytes]:
    encoder = translate.InferStreamEncoder(plan, started_at=started_at, token_texts=token_texts)

    def encode(item: object) -> list[dict[str, Any]]:
        now = time.perf_counter()
        if isinstance(item, tuple):
            return encoder.events(item[0], item[1], now)
        if isinstance(item, Delta):
            return encoder.events(item, None, now)
        if isinstance(item, ChoiceEnd):
            return [encoder.final(item, now)]
        return []

    sampling = plan.request.sampling
    may_end = EndCandidates(
        max_new_tokens=sampling.max_new_tokens,
        stop_strings=bool(sampling.stop),
        stop_token_ids=(eos_token_id,),
    )
    return _guarded_stream(events, encode, (sse_event, errors.stream_error), may_end)


async def _guarded_stream(
    events: EventStream,
    encode: Callable[[object], list[dict[str, Any]]],
    framing: tuple[Callable[[bytes], bytes], Callable[[GatewayError], bytes]],
    may_end: Callable[[Delta], bool],
) -> AsyncIterator[bytes]:
    """Encode and frame every event; a failure after the first byte becomes an in-band error."""
    frame, on_error = framing
    paired = with_ends(events, may_end)
    try:
        async for item in paired:
            for payload in encode(item):
                yield frame(jsonio.dumps(payload))
    except GatewayError as exc:
        yield on_error(exc)
    except Exception:
        logger.exception("MindIE stream failed")
        yield on_error(EngineError("Internal error while streaming"))
    finally:
        await paired.aclose()
        await events.aclose()


def vllm_generate(ctx: ProtocolContext) -> Endpoint:
    """MindIE `/generate` with `prompt`: `{"text": ["<prompt> <completion>"]}`, or a stream of
    `{"text": ["<delta>"]}` chunks each followed by a NUL byte."""

    @guarded(errors.render)
    async def endpoint(request: Request) -> Response:
        data = await _json_body(ctx, request, "Failed to parse request context to json")
        body = parse_model(VllmGenerateRequest, data)
        request_id = request_id_header(request) or uuid.uuid4().hex
        plan = translate.vllm_request(body, request_id=request_id, bounds=ctx.bounds)
        if plan.request.stream:
            events = await ctx.service.start(plan.request)
            return _streaming(_vllm_chunks(events, plan.request.sampling.n))
        result = await while_connected(request, ctx.service.generate(plan.request))
        return json_response(translate.to_vllm_response(result, plan))

    return endpoint


def _vllm_chunks(events: EventStream, n: int) -> AsyncIterator[bytes]:
    def encode(item: object) -> list[dict[str, Any]]:
        delta = item[0] if isinstance(item, tuple) else item
        if isinstance(delta, Delta) and delta.text:
            return [translate.vllm_chunk(delta, n)]
        return []

    return _guarded_stream(events, encode, (_nul_framed, errors.chunk_error), _never)


def _never(delta: Delta) -> bool:
    return False  # chunks carry no end marker: no delta needs pairing with its end


def _nul_framed(payload: bytes) -> bytes:
    return payload + b"\0"


def tokenizer(ctx: ProtocolContext) -> Endpoint:
    """`/v1/tokenizer`: `{"token_number": n, "tokens": [text of each token]}`."""

    @guarded(errors.render)
    async def endpoint(request: Request) -> Response:
        data = await _json_body(ctx, request, "Req body converts to json fail.")
        inputs, do_decode = data.get("inputs"), data.get("do_decode")
        if not isinstance(inputs, str):
            raise InvalidRequest("Inputs in request body is invalid.", param="inputs")
        if not inputs:
            raise InvalidRequest(
                f"Inputs data length in [0, {ctx.max_body_bytes}], but the length of inputs is 0",
                param="inputs",
            )
        engine = ctx.service.engine
        token_ids = await engine.tokenize(inputs, add_special_tokens=True)
        texts = engine.token_texts(token_ids) if do_decode is not False else []
        return json_response(translate.to_tokenizer_response(token_ids, texts))

    return endpoint


def data_routes(ctx: ProtocolContext) -> list[BaseRoute]:
    handler = infer(ctx)
    return [
        Route("/infer", handler, methods=["POST"]),
        Route("/infer_token", handler, methods=["POST"]),
        Route("/v1/tokenizer", tokenizer(ctx), methods=["POST"]),
    ]
