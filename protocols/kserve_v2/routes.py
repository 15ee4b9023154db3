"""Triton / KServe v2 routes: health, metadata, config, stats, infer, generate, MindIE extras.

Every model route also answers under `/versions/{v}` (version "1"). Bodies need no Content-Type
(Triton's own tests send none). Health: `/v2/health/{live,ready}` and `…/ready` answer 200 with
an empty body, or 400 when not live/ready, as Triton does (MindIE answers 503 for a busy
server; tritonclient only tests for 200). Non-streaming requests watch for the client going away
and abort the engine request then; streams are closed by `StreamResponse` on disconnect.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Literal, TypeVar, cast

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
    read_json,
    request_id_header,
)
from protocols._common.lookahead import with_ends
from protocols._common.streaming import StreamResponse, sse_event
from protocols.kserve_v2 import errors, tensors
from protocols.kserve_v2.models import (
    MODEL_VERSION,
    ModelRef,
    model_config,
    model_metadata,
    resolve_model,
    server_metadata,
)
from protocols.kserve_v2.schema import InferRequest, StopInferRequest
from protocols.kserve_v2.stats import InferenceStats, RequestTimer
from protocols.kserve_v2.translate import (
    StreamFolder,
    Target,
    TextCall,
    decode_inputs,
    generate_body,
    generate_fields,
    infer_call,
    output_plan,
    response_header,
    select_outputs,
    text_call,
    text_outputs,
    token_outputs,
)
from server.core.collect import collect
from server.core.errors import EngineError, GatewayError
from server.core.service import EventStream
from server.core.types import GenerationRequest, GenerationResult

logger = logging.getLogger("gateway.kserve_v2")
SSE_TYPE = "text/event-stream; charset=utf-8"
T = TypeVar("T")


class KserveApi:
    """The endpoints, sharing the protocol context and this protocol's statistics."""

    def __init__(self, ctx: ProtocolContext, stats: InferenceStats) -> None:
        self.ctx = ctx
        self.service = ctx.service
        self.stats = stats

    # ---- health and metadata -------------------------------------------------------------
    async def server_metadata(self, request: Request) -> Response:
        return json_response(server_metadata(self.ctx.server_version))

    async def live(self, request: Request) -> Response:
        return Response(status_code=200 if self.service.lifecycle.live else 400)

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.service.lifecycle.accepting else 400)

    async def model_ready(self, request: Request) -> Response:
        self.model(request)
        if not self.service.lifecycle.accepting:
            return json_response({"error": "Model version not ready"}, 400)
        return Response(status_code=200)

    async def metadata(self, request: Request) -> Response:
        return json_response(model_metadata(self.model(request)))

    async def config(self, request: Request) -> Response:
        return json_response(model_config(self.model(request), self.service.served_name))

    async def model_stats(self, request: Request) -> Response:
        return json_response(self.stats.to_json([self.model(request).name], MODEL_VERSION))

    async def all_stats(self, request: Request) -> Response:
        names = [self.service.served_name, *self.service.adapters.names()]
        return json_response(self.stats.to_json(names, MODEL_VERSION))

    async def slot_count(self, request: Request) -> Response:
        """MindIE: slots are engine sequences; busy = admitted requests or engine sequences."""
        self.model(request)
        info, stats = self.service.engine.info(), self.service.engine.stats()
        busy = max(stats.running + stats.waiting, self.service.lifecycle.inflight)
        return json_response({
            "total_slots": info.max_num_seqs,
            "free_slots": max(0, info.max_num_seqs - busy),
            "available_tokens_length": stats.free_blocks * info.block_size,
        })

    async def stop_infer(self, request: Request) -> Response:
        """MindIE: cancel the running request(s) with this id; 200 echoes the body."""
        self.model(request)
        body = await read_json(request, self.ctx.max_body_bytes)
        self.service.cancel(parse_model(StopInferRequest, body).id)
        return json_response(body)

    # ---- inference ---------------------------------------------------------------------------
    async def infer(self, request: Request) -> Response:
        model = self.model(request)
        return await self.counted(model, lambda timer: self._infer(request, model, timer))

    async def _infer(self, request: Request, model: ModelRef, timer: RequestTimer) -> Response:
        body = tensors.inflate(
            await read_body(request, self.ctx.max_body_bytes),
            request.headers.get("content-encoding"), self.ctx.max_body_bytes,
        )
        head, raw = tensors.split_body(body, request.headers.get(tensors.HEADER_LENGTH))
        wire = parse_model(InferRequest, decode_json(head))
        target = self.target(request, model, wire.id)
        call = infer_call(wire, decode_inputs(wire.inputs, raw, model.name), target)
        timer.mark()
        result = await self.run(request, call.request, timer)
        produced = text_outputs(result, call) if isinstance(call, TextCall) else token_outputs(
            result, call
        )
        outputs, binary = select_outputs(produced, output_plan(wire))
        content, length = tensors.encode_response(
            response_header(model, target.client_id), outputs, binary
        )
        if length is None:
            return Response(content, media_type="application/json")
        headers = {"inference-header-content-length": str(length)}
        return Response(content, headers=headers, media_type="application/octet-stream")

    async def generate(self, request: Request) -> Response:
        model = self.model(request)
        return await self.counted(model, lambda timer: self._generate(request, model, timer))

    async def _generate(self, request: Request, model: ModelRef, timer: RequestTimer) -> Response:
        call, header = await self.generate_call(request, model, stream=False)
        timer.mark()
        result = await self.run(request, call.request, timer)
        return json_response(generate_body(result, call, header))

    async def generate_stream(self, request: Request) -> Response:
        """Errors before the first event are JSON with a status; later ones are SSE events."""
        model = self.model(request)
        timer = self.stats.timer(model.name)
        try:
            call, header = await self.generate_call(request, model, stream=True)
            timer.mark()
            stream = await self.service.start(call.request)
            timer.mark()
        except BaseException:
            timer.failure()
            raise
        response = StreamResponse(self.events(stream, call, header, timer), media_type=SSE_TYPE)
        return cast(Response, response)  # an ASGI response; Starlette only calls it

    async def events(
        self, stream: EventStream, call: TextCall, header: dict[str, Any], timer: RequestTimer
    ) -> AsyncIterator[bytes]:
        ok = False
        payloads = self._payloads(stream, call, header)
        try:
            async for payload in payloads:
                yield sse_event(jsonio.dumps(payload))
            ok = True
        except Exception as exc:
            if not isinstance(exc, GatewayError):
                logger.exception("unexpected error in a generate_stream")
                exc = EngineError("Internal error while streaming the response")
            yield errors.stream_error(exc)
        finally:
            await payloads.aclose()
            await stream.aclose()
            timer.mark()
            if ok:
                timer.success()
            else:
                timer.failure()

    async def _payloads(
        self, stream: EventStream, call: TextCall, header: dict[str, Any]
    ) -> AsyncGenerator[dict[str, Any], None]:
        if not call.stream:  # `stream: false`: one event with the whole answer, as Triton
            result = await collect(stream, request_id=stream.request.request_id, model="")
            yield {**generate_body(result, call, header), "done": True}
            return
        folder = StreamFolder(call, header)
        pairs = with_ends(stream)
        try:
            async for item in pairs:
                payload = folder.fold(item)
                if payload is not None:
                    yield payload
        finally:
            await pairs.aclose()
        last = folder.close()
        if last is not None:
            yield last

    # ---- helpers -------------------------------------------------------------------------------
    def model(self, request: Request) -> ModelRef:
        return resolve_model(
            request.path_params["model"], request.path_params.get("version"),
            base_names=self.service.base_names,
            adapters=frozenset(self.service.adapters.names()),
        )

    def target(self, request: Request, model: ModelRef, client_id: str | None) -> Target:
        """The engine-facing id is the client's Triton/MindIE id, else X-Request-Id, else new."""
        request_id = client_id or request_id_header(request) or f"kserve-{uuid.uuid4().hex}"
        return Target(
            model=model, request_id=request_id, client_id=client_id or None,
            bounds=self.ctx.bounds, adapters=frozenset(self.service.adapters.names()),
            vocab_size=self.service.engine.info().vocab_size,
        )

    async def generate_call(
        self, request: Request, model: ModelRef, *, stream: bool
    ) -> tuple[TextCall, dict[str, Any]]:
        body = await read_json(request, self.ctx.max_body_bytes)
        client_id, inputs, params = generate_fields(body, model.name)
        target = self.target(request, model, client_id)
        route: Literal["generate", "generate_stream"] = "generate_stream" if stream else "generate"
        return text_call(inputs, params, target, route=route), response_header(model, client_id)

    async def counted(
        self, model: ModelRef, handle: Callable[[RequestTimer], Awaitable[Response]]
    ) -> Response:
        timer = self.stats.timer(model.name)
        try:
            response = await handle(timer)
        except BaseException:
            timer.failure()
            raise
        timer.success()
        return response

    async def run(
        self, request: Request, generation: GenerationRequest, timer: RequestTimer
    ) -> GenerationResult:
        """Generate to the end, unless the client disconnects first (then abort)."""

        async def work() -> GenerationResult:
            stream = await self.service.start(generation)
            timer.mark()
            try:
                return await collect(stream, request_id=generation.request_id, model="")
            finally:
                await stream.aclose()

        result = await while_connected(request, work())
        timer.mark()
        return result


def data_routes(ctx: ProtocolContext) -> list[BaseRoute]:
    api = KserveApi(ctx, InferenceStats())
    guard = guarded(errors.render)
    routes: list[BaseRoute] = [
        Route("/v2", guard(api.server_metadata), methods=["GET"]),
        Route("/v2/health/live", guard(api.live), methods=["GET"]),
        Route("/v2/health/ready", guard(api.ready), methods=["GET"]),
        Route("/v2/models/stats", guard(api.all_stats), methods=["GET"]),
    ]
    model_routes: list[tuple[str, Endpoint, str]] = [
        ("", api.metadata, "GET"),
        ("/ready", api.model_ready, "GET"),
        ("/config", api.config, "GET"),
        ("/stats", api.model_stats, "GET"),
        ("/infer", api.infer, "POST"),
        ("/generate", api.generate, "POST"),
        ("/generate_stream", api.generate_stream, "POST"),
        ("/stopInfer", api.stop_infer, "POST"),
        ("/getSlotCount", api.slot_count, "GET"),
    ]
    for suffix, endpoint, method in model_routes:
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            routes.append(Route(prefix + suffix, guard(endpoint), methods=[method]))
    return routes
