"""TGI routes: POST /generate, /generate_stream, / (compat) and /tokenize; GET /info, /health, /.

`generate` and `tokenize` are exported for the gateway's body dispatch of the shared paths
`/generate` and `/tokenize`; their routes are mounted there, not here.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from protocols._common import jsonio
from protocols._common.context import ProtocolContext
from protocols._common.disconnect import while_connected
from protocols._common.guard import Endpoint, guarded
from protocols._common.http import (
    decode_json,
    json_response,
    parse_model,
    read_body,
    request_id_header,
)
from protocols._common.lookahead import EndCandidates, with_ends
from protocols._common.streaming import StreamResponse, sse_event
from protocols.tgi import errors, translate
from protocols.tgi.schema import GenerateRequest
from server.core.errors import AdapterNotFound, EngineError, GatewayError
from server.core.service import EventStream
from server.core.types import ChoiceEnd, Delta, GenerationRequest, Started

COMPUTE_TYPE = "vllm"
logger = logging.getLogger("gateway.protocols.tgi")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Prepared:
    body: GenerateRequest
    plan: translate.Plan
    request: GenerationRequest
    rendering: translate.Rendering
    started_at: float
    validated_at: float


def _limits(ctx: ProtocolContext) -> translate.Limits:
    return translate.Limits.of(ctx.bounds, ctx.service.engine.info().max_model_len)


async def _read(ctx: ProtocolContext, request: Request) -> GenerateRequest:
    return parse_model(GenerateRequest, decode_json(await read_body(request, ctx.max_body_bytes)))


async def _prepare(
    ctx: ProtocolContext, request: Request, body: GenerateRequest, *, stream: bool
) -> _Prepared:
    started_at = time.perf_counter()
    limits = _limits(ctx)
    plan = translate.plan(body, limits, stream=stream)
    _check_adapter(ctx, plan.adapter)
    engine = ctx.service.engine
    token_ids = await engine.tokenize(body.inputs, add_special_tokens=True)
    request_id = request_id_header(request) or uuid.uuid4().hex
    gen = translate.to_generation_request(plan, token_ids, request_id=request_id, limits=limits)
    rendering = translate.Rendering(plan=plan, eos_token_id=engine.info().eos_token_id)
    return _Prepared(
        body=body,
        plan=plan,
        request=gen,
        rendering=rendering,
        started_at=started_at,
        validated_at=time.perf_counter(),
    )


def _check_adapter(ctx: ProtocolContext, name: str) -> None:
    """Unknown `adapter_id` → 422 (TGI would silently use the base model)."""
    service = ctx.service
    if name and name not in service.base_names and name not in service.adapters:
        known = ", ".join(sorted(service.adapters.names())) or "none"
        raise AdapterNotFound(
            f"adapter_id `{name}` is not a loaded adapter (loaded: {known})",
            param="parameters.adapter_id",
        )


async def _run(
    ctx: ProtocolContext, prepared: _Prepared
) -> tuple[dict[str, object], dict[str, str]]:
    result = await ctx.service.generate(prepared.request)
    rendering = prepared.rendering
    if prepared.plan.prefill:
        texts = ctx.service.engine.token_texts(list(result.prompt.prompt_token_ids))
        rendering = translate.Rendering(
            plan=prepared.plan, eos_token_id=rendering.eos_token_id, prefill_texts=texts
        )
    body = translate.to_generate_response(result, rendering)
    generated = len(translate.best_first(result.choices)[0].token_ids)
    return body, _timing_headers(prepared, len(result.prompt.prompt_token_ids), generated)


def _timing_headers(prepared: _Prepared, prompt_tokens: int, generated: int) -> dict[str, str]:
    now = time.perf_counter()
    total = now - prepared.started_at
    inference_ms = int((now - prepared.validated_at) * 1000)
    return {
        "x-compute-type": COMPUTE_TYPE,
        "x-compute-time": repr(total),
        "x-compute-characters": str(len(prepared.body.inputs)),
        "x-total-time": str(int(total * 1000)),
        "x-validation-time": str(int((prepared.validated_at - prepared.started_at) * 1000)),
        "x-inference-time": str(inference_ms),
        "x-time-per-token": str(inference_ms // max(generated, 1)),
        "x-prompt-tokens": str(prompt_tokens),
        "x-generated-tokens": str(generated),
    }


async def _stream(ctx: ProtocolContext, prepared: _Prepared) -> Response:
    events = await ctx.service.start(prepared.request)
    headers = {
        "x-compute-type": COMPUTE_TYPE,
        "x-compute-characters": str(len(prepared.body.inputs)),
    }
    # StreamResponse is a plain ASGI response, which Starlette's endpoints may return.
    return cast(
        Response,
        StreamResponse(
            _sse(events, prepared.rendering, ctx.service.engine.token_texts), headers=headers
        ),
    )


async def _sse(
    events: EventStream,
    rendering: translate.Rendering,
    token_texts: Callable[[list[int]], list[str]],
) -> AsyncIterator[bytes]:
    encoder: translate.StreamEncoder | None = None
    sampling = events.request.sampling
    may_end = EndCandidates(
        max_new_tokens=sampling.max_new_tokens,
        stop_token_ids=(rendering.eos_token_id,),
        stop_strings=bool(sampling.stop),
    )
    paired = with_ends(events, may_end)
    try:
        async for item in paired:
            if isinstance(item, Started):
                input_length = len(item.prompt_token_ids)
                encoder = translate.StreamEncoder(
                    rendering, input_length=input_length, token_texts=token_texts
                )
                continue
            if encoder is None:
                continue
            for event in _events(encoder, item):
                yield sse_event(jsonio.dumps(event))
    except GatewayError as exc:
        yield errors.stream_error(exc)
    except Exception:
        logger.exception("TGI stream failed")
        yield errors.stream_error(EngineError("Internal error while streaming"))
    finally:
        await paired.aclose()
        await events.aclose()


def _events(encoder: translate.StreamEncoder, item: object) -> list[dict[str, object]]:
    if isinstance(item, tuple):
        delta, end = item
        return encoder.events(delta, end)
    if isinstance(item, Delta):
        return encoder.events(item, None)
    if isinstance(item, ChoiceEnd):
        return [encoder.final(item)]
    return []


def generate(ctx: ProtocolContext) -> Endpoint:
    """TGI `POST /generate`: one JSON object."""

    @guarded(errors.render)
    async def endpoint(request: Request) -> Response:
        prepared = await _prepare(ctx, request, await _read(ctx, request), stream=False)
        body, headers = await while_connected(request, _run(ctx, prepared))
        return json_response(body, headers=headers)

    return endpoint


def generate_stream(ctx: ProtocolContext) -> Endpoint:
    """TGI `POST /generate_stream`: one SSE event per token, no terminator."""

    @guarded(errors.render)
    async def endpoint(request: Request) -> Response:
        prepared = await _prepare(ctx, request, await _read(ctx, request), stream=True)
        return await _stream(ctx, prepared)

    return endpoint


def compat(ctx: ProtocolContext) -> Endpoint:
    """TGI `POST /`: a one-element list, or the `/generate_stream` events when `stream` is true."""

    @guarded(errors.render)
    async def endpoint(request: Request) -> Response:
        body = await _read(ctx, request)
        prepared = await _prepare(ctx, request, body, stream=bool(body.stream))
        if prepared.plan.stream:
            return await _stream(ctx, prepared)
        result, headers = await while_connected(request, _run(ctx, prepared))
        return json_response([result], headers=headers)

    return endpoint


def tokenize(ctx: ProtocolContext) -> Endpoint:
    """TGI `POST /tokenize`: `[{"id", "text", "start", "stop"}]` with byte offsets into `inputs`."""

    @guarded(errors.render)
    async def endpoint(request: Request) -> Response:
        body = await _read(ctx, request)
        if not body.inputs:
            raise translate.invalid("`inputs` cannot be empty")
        engine = ctx.service.engine
        token_ids = await engine.tokenize(body.inputs, add_special_tokens=True)
        texts = engine.token_texts(token_ids)
        return json_response(translate.to_tokenize_response(body.inputs, token_ids, texts))

    return endpoint


def info(ctx: ProtocolContext) -> Endpoint:
    """TGI `GET /info`, with MindIE's extra fields."""

    @guarded(errors.render)
    async def endpoint(request: Request) -> Response:
        service = ctx.service
        engine_info = service.engine.info()
        facts = translate.ServerFacts(
            served_name=service.served_name,
            version=ctx.server_version,
            max_concurrent_requests=service.limits.max_concurrent,
            max_client_batch_size=ctx.bounds.max_prompts,
            kv_cache_tokens=service.engine.stats().total_blocks * engine_info.block_size,
        )
        return json_response(translate.to_info(engine_info, _limits(ctx), facts))

    return endpoint


def health(ctx: ProtocolContext) -> Endpoint:
    """TGI /health: 200 with an empty body when serving, else 503 with TGI's error body."""

    async def endpoint(request: Request) -> Response:
        if ctx.service.lifecycle.accepting:
            return Response(status_code=200)
        return json_response({"error": "unhealthy", "error_type": "healthcheck"}, 503)

    return endpoint


def data_routes(ctx: ProtocolContext) -> list[BaseRoute]:
    return [
        Route("/health", health(ctx), methods=["GET"]),
        Route("/", health(ctx), methods=["GET"]),
        Route("/", compat(ctx), methods=["POST"]),
        Route("/generate_stream", generate_stream(ctx), methods=["POST"]),
        Route("/info", info(ctx), methods=["GET"]),
    ]
