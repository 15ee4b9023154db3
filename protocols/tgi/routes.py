"""TGI routes: POST /generate, /generate_stream, / (compat) and /tokenize; GET /info, /health, /.

`/generate` and `/tokenize` are shared paths: TGI's routes are their defaults, bodies with
`prompt` (MindIE's vLLM flavour, vLLM's tokenize) or `messages` go to the other protocols.
With `ProtocolConfig.tgiCompat`, SageMaker's `/invocations` bodies with a string `inputs` are
TGI's too (`POST /`'s answer); otherwise DJL's `/invocations` answers them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from protocols.common import sagemaker
from protocols.common.sse import TokenEventStream
from protocols.tgi import errors, translate
from protocols.tgi.schema import GenerateRequest
from server.core.errors import AdapterNotFound
from server.core.frozen import quick_init
from server.core.types import Delta, GenerationEvent, GenerationRequest, Started
from server.http.body import decode_json, json_response, parse_model, read_body, request_id_header
from server.http.context import ProtocolContext, current_request_id, options_of
from server.http.disconnect import until_disconnect
from server.http.routes import Access, Answer, Doc, Endpoint, Route, RouteList
from server.http.streaming import EventStreamAnswer

COMPUTE_TYPE = "vllm"
_COMPUTE_TYPE = COMPUTE_TYPE.encode()
NAME = "tgi"


@dataclass(frozen=True, slots=True, kw_only=True)
class TgiOptions:
    """TGI's settings, declared through its spec."""

    # ProtocolConfig.tgiCompat (DJL's option.tgi_compat): SageMaker /invocations bodies with a
    # string `inputs` are TGI's
    tgi_compat: bool = False


@quick_init
@dataclass(frozen=True, slots=True, kw_only=True)
class _Prepared:
    body: GenerateRequest
    plan: translate.Plan
    request: GenerationRequest
    rendering: translate.Rendering
    started_at: float
    validated_at: float


def _limits(ctx: ProtocolContext) -> translate.Limits:
    return translate.Limits.of(ctx.bounds, ctx.service.info().max_model_len)


async def _read(ctx: ProtocolContext, request: Request) -> GenerateRequest:
    return parse_model(GenerateRequest, decode_json(await read_body(request, ctx.max_body_bytes)))


def _prepare(
    ctx: ProtocolContext, request: Request, body: GenerateRequest, *, stream: bool,
    full_text: bool = False, adapter: str | None = None,
) -> _Prepared:
    """Validate and plan; the engine fits the tokenized prompt (`translate.TGI_BUDGET`).
    `adapter`, when given, wins over `parameters.adapter_id`."""
    started_at = time.perf_counter()
    limits = _limits(ctx)
    plan = translate.plan(
        body, limits, stream=stream, defaults=ctx.service.defaults(), full_text=full_text,
        adapter=adapter,
    )
    _check_adapter(ctx, plan.adapter)
    request_id = request_id_header(request) or current_request_id()
    gen = translate.to_generation_request(plan, request_id=request_id)
    rendering = translate.Rendering(plan=plan, eos_token_id=ctx.service.info().eos_token_id)
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
    if not service.knows(name):
        known = ", ".join(sorted(service.adapters.names())) or "none"
        raise AdapterNotFound(
            f"adapter_id `{name}` is not a loaded adapter (loaded: {known})",
            param="parameters.adapter_id",
        )


async def _run(
    ctx: ProtocolContext, prepared: _Prepared
) -> tuple[dict[str, object], list[tuple[bytes, bytes]]]:
    result = await ctx.service.generate(prepared.request)
    rendering = prepared.rendering
    if prepared.plan.prefill:
        texts = ctx.service.token_texts(list(result.prompt.prompt_token_ids))
        rendering = translate.Rendering(
            plan=prepared.plan, eos_token_id=rendering.eos_token_id, prefill_texts=texts
        )
    body = translate.to_generate_response(result, rendering)
    generated = len(translate.best_first(result.choices)[0].token_ids)
    return body, _timing_headers(prepared, len(result.prompt.prompt_token_ids), generated)


def _timing_headers(
    prepared: _Prepared, prompt_tokens: int, generated: int
) -> list[tuple[bytes, bytes]]:
    """TGI's timing headers, already encoded (every non-streamed answer carries nine)."""
    now = time.perf_counter()
    total = now - prepared.started_at
    inference_ms = int((now - prepared.validated_at) * 1000)
    return [
        (b"x-compute-type", _COMPUTE_TYPE),
        (b"x-compute-time", repr(total).encode()),
        (b"x-compute-characters", b"%d" % len(prepared.body.inputs)),
        (b"x-total-time", b"%d" % int(total * 1000)),
        (b"x-validation-time", b"%d" % int((prepared.validated_at - prepared.started_at) * 1000)),
        (b"x-inference-time", b"%d" % inference_ms),
        (b"x-time-per-token", b"%d" % (inference_ms // max(generated, 1))),
        (b"x-prompt-tokens", b"%d" % prompt_tokens),
        (b"x-generated-tokens", b"%d" % generated),
    ]


def _with_headers(response: Response, headers: list[tuple[bytes, bytes]]) -> Response:
    response.raw_headers += headers
    return response


class _Events(TokenEventStream):
    """TGI's stream: one SSE event per token, no terminator; errors as `{"error", ...}`."""

    def __init__(
        self, rendering: translate.Rendering, token_texts: Callable[[list[int]], list[str]]
    ) -> None:
        super().__init__(errors.stream_error)
        self._rendering = rendering
        self._token_texts = token_texts
        self._encoder: translate.StreamEncoder | None = None

    def encode(self, event: GenerationEvent) -> bytes:
        encoder = self._encoder
        if type(event) is Delta:
            if encoder is None:
                return b""
            frame = encoder.plain_frame(event, b"data: ", b"\n\n")
            return self.general(event) if frame is None else frame
        return super().encode(event)

    def other(self, event: GenerationEvent) -> bytes:
        if isinstance(event, Started):
            self._encoder = translate.StreamEncoder(
                self._rendering,
                input_length=len(event.prompt_token_ids),
                token_texts=self._token_texts,
            )
        return b""

    def events(self, delta: Delta) -> list[dict[str, Any]]:
        assert self._encoder is not None
        return self._encoder.events(delta)


async def _stream(ctx: ProtocolContext, prepared: _Prepared) -> Answer:
    events = await ctx.service.start(prepared.request)
    headers = {
        "x-compute-type": COMPUTE_TYPE,
        "x-compute-characters": str(len(prepared.body.inputs)),
    }
    fmt = _Events(prepared.rendering, ctx.service.token_texts)
    return EventStreamAnswer(events, fmt, headers=headers)


def generate(ctx: ProtocolContext) -> Endpoint:
    """TGI `POST /generate`: one JSON object."""

    async def endpoint(request: Request) -> Answer:
        prepared = _prepare(ctx, request, await _read(ctx, request), stream=False)
        body, headers = await until_disconnect(request, _run(ctx, prepared))
        return _with_headers(json_response(body), headers)

    return endpoint


def generate_stream(ctx: ProtocolContext) -> Endpoint:
    """TGI `POST /generate_stream`: one SSE event per token, no terminator."""

    async def endpoint(request: Request) -> Answer:
        prepared = _prepare(ctx, request, await _read(ctx, request), stream=True)
        return await _stream(ctx, prepared)

    return endpoint


async def _compat(
    ctx: ProtocolContext, request: Request, adapter: str | None = None
) -> Answer:
    body = await _read(ctx, request)
    prepared = _prepare(
        ctx, request, body, stream=bool(body.stream), full_text=True, adapter=adapter
    )
    if prepared.plan.stream:
        return await _stream(ctx, prepared)
    result, headers = await until_disconnect(request, _run(ctx, prepared))
    return _with_headers(json_response([result]), headers)


def compat(ctx: ProtocolContext) -> Endpoint:
    """TGI `POST /`: a one-element list, or the `/generate_stream` events when `stream` is true.
    An omitted `return_full_text` is true: TGI's default for a text-generation model."""

    async def endpoint(request: Request) -> Answer:
        return await _compat(ctx, request)

    return endpoint


def invocations(ctx: ProtocolContext) -> Endpoint:
    """SageMaker `/invocations` with a TGI body: TGI's `POST /` (`sagemaker.rs`). DJL's adapter
    selectors (`?adapter=`, `?model_name=`, the SageMaker headers; `protocols/common/sagemaker.py`)
    name the adapter over `parameters.adapter_id`."""

    async def endpoint(request: Request) -> Answer:
        names = sagemaker.selectors(request, ctx.service).names(1)
        return await _compat(ctx, request, None if names is None else names[0])

    return endpoint


def tgi_body(data: object) -> bool:
    """A TGI body on the shared `/invocations`: a string `inputs` and no DJL `adapters` (DJL's
    bodies, a list of inputs or adapters named per input, stay DJL's)."""
    return isinstance(data, dict) and isinstance(data.get("inputs"), str) and "adapters" not in data


def tokenize(ctx: ProtocolContext) -> Endpoint:
    """TGI `POST /tokenize`: `[{"id", "text", "start", "stop"}]` with byte offsets into `inputs`."""

    async def endpoint(request: Request) -> Answer:
        body = await _read(ctx, request)
        if not body.inputs:
            raise translate.invalid("`inputs` cannot be empty")
        service = ctx.service
        token_ids = await service.tokenize(body.inputs, add_special_tokens=True)
        texts = service.token_texts(token_ids)
        return json_response(translate.to_tokenize_response(body.inputs, token_ids, texts))

    return endpoint


def info(ctx: ProtocolContext) -> Endpoint:
    """TGI `GET /info`, with MindIE's extra fields."""

    async def endpoint(request: Request) -> Answer:
        service = ctx.service
        engine_info = service.info()
        facts = translate.ServerFacts(
            served_name=service.served_name,
            version=ctx.server_version,
            max_concurrent_requests=service.limits.max_concurrent,
            max_client_batch_size=ctx.bounds.max_prompts,
            kv_cache_tokens=service.stats().total_blocks * engine_info.block_size,
        )
        return json_response(translate.to_info(engine_info, _limits(ctx), facts))

    return endpoint


def health(ctx: ProtocolContext) -> Endpoint:
    """TGI /health: 200 with an empty body when serving, else 503 with TGI's error body."""

    async def endpoint(request: Request) -> Answer:
        if ctx.service.lifecycle.accepting:
            return Response(status_code=200)
        return json_response({"error": "unhealthy", "error_type": "healthcheck"}, 503)

    return endpoint


def routes(ctx: ProtocolContext) -> list[Route]:
    out = RouteList(owner=NAME, render=errors.render)
    probe, control = health(ctx), frozenset({"control"})  # TGI's /health wins on a shared port
    out.get("/health", probe, access=Access.OPEN, overrides=control,
            doc=Doc(summary="Health (open)"))
    out.get("/", probe, access=Access.OPEN, doc=Doc(summary="Health alias (open)"))
    body = GenerateRequest
    out.post("/", compat(ctx),
             doc=Doc(summary="Generate, streamed when `stream` is true", body=body, streams=True))
    if options_of(TgiOptions, ctx).tgi_compat:
        out.post("/invocations", invocations(ctx), claim=tgi_body,
                 doc=Doc(summary="SageMaker: TGI (string `inputs`, tgiCompat)", body=body,
                         streams=True))
    out.post("/generate", generate(ctx), doc=Doc(summary="TGI generate", body=body))
    out.post("/generate_stream", generate_stream(ctx),
             doc=Doc(summary="Generate as SSE", body=body, streams=True))
    out.post("/tokenize", tokenize(ctx), doc=Doc(summary="TGI tokenize", body=body))
    out.get("/info", info(ctx), doc=Doc(summary="Model and router info"))
    return out.routes
