"""Triton / KServe v2 routes: health, metadata, config, stats, infer, generate, MindIE extras.

Every model route also answers under `/versions/{v}` (version "1"). Bodies need no Content-Type
(Triton's own tests send none). Health: `/v2/health/{live,ready}` and `…/ready` answer the Open
Inference Protocol's bodies (`{"live": …}`, `{"ready": …}`, `{"name": …, "ready": …}`, which
KServe's InferenceRESTClient reads) with 200, or 400 when not live/ready, as Triton does
(MindIE answers 503 for a busy server; tritonclient only tests for 200). Non-streaming requests
watch for the client going away and abort the engine request then; streams are closed by
`StreamResponse` on disconnect.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import Response

from protocols.kserve_v2 import errors, schema, tensors
from protocols.kserve_v2.models import (
    MODEL_VERSION,
    ModelRef,
    model_config,
    model_metadata,
    repository_index,
    resolve_model,
    served_model_names,
    server_metadata,
)
from protocols.kserve_v2.schema import InferRequest
from protocols.kserve_v2.stats import InferenceStats, RequestTimer, stats_of
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
    stop_infer_id,
    text_call,
    text_outputs,
    token_outputs,
)
from server.core.collect import collect, fold
from server.core.errors import GatewayError, InvalidRequest
from server.core.types import Delta, GenerationEvent, GenerationRequest, GenerationResult
from server.http import jsonio
from server.http.body import (
    decode_json,
    json_response,
    parse_model,
    read_body,
    read_json,
    request_id_header,
)
from server.http.context import ProtocolContext, current_request_id
from server.http.disconnect import until_disconnect
from server.http.routes import Access, Answer, Doc, Endpoint, Route, RouteList
from server.http.streaming import EventStreamAnswer, sse_event

NAME = "kserve"
SSE_TYPE = "text/event-stream; charset=utf-8"


class KserveApi:
    """The endpoints, sharing the protocol context and this protocol's statistics."""

    def __init__(self, ctx: ProtocolContext, stats: InferenceStats) -> None:
        self.ctx = ctx
        self.service = ctx.service
        self.stats = stats

    # ---- health and metadata -------------------------------------------------------------
    async def server_metadata(self, request: Request) -> Answer:
        return json_response(server_metadata(self.ctx.server_version))

    async def live(self, request: Request) -> Answer:
        live = self.service.lifecycle.live
        return json_response({"live": live}, 200 if live else 400)

    async def ready(self, request: Request) -> Answer:
        ready = self.service.lifecycle.accepting
        return json_response({"ready": ready}, 200 if ready else 400)

    async def model_ready(self, request: Request) -> Answer:
        name = self.model(request).name
        ready = self.service.lifecycle.accepting
        return json_response({"name": name, "ready": ready}, 200 if ready else 400)

    async def metadata(self, request: Request) -> Answer:
        return json_response(model_metadata(self.model(request)))

    async def config(self, request: Request) -> Answer:
        return json_response(model_config(self.model(request), self.service.served_name))

    async def model_stats(self, request: Request) -> Answer:
        return json_response(await self.stats.to_json([self.model(request).name], MODEL_VERSION))

    async def all_stats(self, request: Request) -> Answer:
        names = served_model_names(self.service)
        return json_response(await self.stats.to_json(names, MODEL_VERSION))

    async def repository_index(self, request: Request) -> Answer:
        """Triton's body is optional: `{"ready": true}` lists only the ready models."""
        raw = await read_body(request, self.ctx.max_body_bytes)
        data = decode_json(raw) if raw.strip() else {}
        if not isinstance(data, dict):
            raise InvalidRequest("The request body must be a JSON object")
        ready = data.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidRequest("Unable to parse 'ready': expected a boolean", param="ready")
        index = repository_index(
            served_model_names(self.service), accepting=self.service.lifecycle.accepting,
            ready_only=ready,
        )
        return json_response(index)

    async def slot_count(self, request: Request) -> Answer:
        """MindIE: slots are engine sequences; busy = admitted requests or engine sequences."""
        self.model(request)
        info, stats = self.service.info(), self.service.stats()
        busy = max(stats.running + stats.waiting, self.service.lifecycle.inflight)
        return json_response({
            "total_slots": info.max_num_seqs,
            "free_slots": max(0, info.max_num_seqs - busy),
            "available_tokens_length": stats.free_blocks * info.block_size,
        })

    async def stop_infer(self, request: Request) -> Answer:
        """MindIE: cancel the running request(s) with this id; 200 echoes the body."""
        self.model(request)
        stop_id, body = stop_infer_id(await read_body(request, self.ctx.max_body_bytes))
        await self.service.cancel(stop_id)
        return json_response(body)

    # ---- inference ---------------------------------------------------------------------------
    async def infer(self, request: Request) -> Answer:
        model = self.model(request)
        return await self.counted(model, lambda timer: self._infer(request, model, timer))

    async def _infer(self, request: Request, model: ModelRef, timer: RequestTimer) -> Answer:
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

    async def generate(self, request: Request) -> Answer:
        model = self.model(request)
        return await self.counted(model, lambda timer: self._generate(request, model, timer))

    async def _generate(self, request: Request, model: ModelRef, timer: RequestTimer) -> Answer:
        call, header = await self.generate_call(request, model, stream=False)
        timer.mark()
        result = await self.run(request, call.request, timer)
        return json_response(generate_body(result, call, header))

    async def generate_stream(self, request: Request) -> Answer:
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
        if not call.stream:  # `stream: false`: one event with the whole answer, as Triton
            fmt: _Whole | _Deltas = _Whole(call, header)
        else:
            fmt = _Deltas(StreamFolder(call, header))
        return EventStreamAnswer(stream, fmt, media_type=SSE_TYPE, on_close=timer.finished)

    # ---- helpers -------------------------------------------------------------------------------
    def model(self, request: Request) -> ModelRef:
        return resolve_model(
            request.path_params["model"], request.path_params.get("version"),
            base_names=self.service.base_names,
            adapters=self.service.adapters,
        )

    def target(self, request: Request, model: ModelRef, client_id: str | None) -> Target:
        """The engine-facing id is the client's Triton/MindIE id, else X-Request-Id, else new."""
        request_id = client_id or request_id_header(request) or f"kserve-{current_request_id()}"
        return target_for(self.ctx, model, request_id=request_id, client_id=client_id)

    async def generate_call(
        self, request: Request, model: ModelRef, *, stream: bool
    ) -> tuple[TextCall, dict[str, Any]]:
        body = await read_json(request, self.ctx.max_body_bytes)
        client_id, inputs, params = generate_fields(body, model.name)
        target = self.target(request, model, client_id)
        route: Literal["generate", "generate_stream"] = "generate_stream" if stream else "generate"
        return text_call(inputs, params, target, route=route), response_header(model, client_id)

    async def counted(
        self, model: ModelRef, handle: Callable[[RequestTimer], Awaitable[Answer]]
    ) -> Answer:
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

        result = await until_disconnect(request, work())
        timer.mark()
        return result


def target_for(
    ctx: ProtocolContext, model: ModelRef, *, request_id: str, client_id: str | None
) -> Target:
    """A request's target under the service's limits and facts (HTTP and gRPC alike)."""
    service = ctx.service
    return Target(
        model=model, request_id=request_id, client_id=client_id or None, bounds=ctx.bounds,
        adapters=service.adapters, vocab_size=service.info().vocab_size,
        defaults=service.defaults(),
    )


class _Deltas:
    """`generate_stream`: one SSE event per engine delta (see `StreamFolder`)."""

    def __init__(self, folder: StreamFolder) -> None:
        self._folder = folder

    def encode(self, event: GenerationEvent) -> bytes:
        if type(event) is Delta:
            frame = self._folder.plain_frame(event, b"data: ", b"\n\n")
            if frame is not None:
                return frame
        payload = self._folder.fold(event)
        return b"" if payload is None else sse_event(jsonio.dumps(payload))

    def error(self, exc: GatewayError) -> bytes:
        return errors.stream_error(exc)

    def end(self) -> bytes:
        last = self._folder.close()
        return b"" if last is None else sse_event(jsonio.dumps(last))


class _Whole:
    """`generate_stream` with `stream: false`: the whole answer as one event."""

    def __init__(self, call: TextCall, header: dict[str, Any]) -> None:
        self._call = call
        self._header = header
        self._events: list[GenerationEvent] = []

    def encode(self, event: GenerationEvent) -> bytes:
        self._events.append(event)
        return b""

    def error(self, exc: GatewayError) -> bytes:
        return errors.stream_error(exc)

    def end(self) -> bytes:
        request = self._call.request
        result = fold(self._events, request_id=request.request_id, model="")
        body = {**generate_body(result, self._call, self._header), "done": True}
        return sse_event(jsonio.dumps(body))


def routes(ctx: ProtocolContext) -> list[Route]:
    api = KserveApi(ctx, stats_of(ctx))
    out = RouteList(owner=NAME, render=errors.render)
    health, control = Access.OPEN, frozenset({"control"})  # Triton's shapes win on a shared port
    out.get("/v2", api.server_metadata, doc=Doc(summary="Server metadata"))
    out.get("/v2/health/live", api.live, access=health, overrides=control,
            doc=Doc(summary="Liveness (open)"))
    out.get("/v2/health/ready", api.ready, access=health, overrides=control,
            doc=Doc(summary="Readiness (open)"))
    out.get("/v2/models/stats", api.all_stats, doc=Doc(summary="Statistics of every model"))
    out.post("/v2/repository/index", api.repository_index,
             doc=Doc(summary="Model repository index (every served model)"))
    model_routes: list[tuple[str, str, Endpoint, Doc, Access]] = [
        ("GET", "", api.metadata, Doc(summary="Model metadata"), Access.DATA),
        ("GET", "/ready", api.model_ready, Doc(summary="Model readiness (open)"), health),
        ("GET", "/config", api.config, Doc(summary="Model configuration"), Access.DATA),
        ("GET", "/stats", api.model_stats, Doc(summary="Model statistics"), Access.DATA),
        ("POST", "/infer", api.infer,
         Doc(summary="Inference (JSON tensors)", body=schema.InferRequest), Access.DATA),
        ("POST", "/generate", api.generate,
         Doc(summary="Generate extension", body=schema.GENERATE_BODY), Access.DATA),
        ("POST", "/generate_stream", api.generate_stream,
         Doc(summary="Generate extension, SSE", body=schema.GENERATE_BODY, streams=True),
         Access.DATA),
        ("POST", "/stopInfer", api.stop_infer,
         Doc(summary="Stop a running request by id (MindIE)", body=schema.StopInferRequest),
         Access.DATA),
        ("GET", "/getSlotCount", api.slot_count, Doc(summary="Free engine slots (MindIE)"),
         Access.DATA),
    ]
    for method, suffix, endpoint, doc, access in model_routes:
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            out.add(method, prefix + suffix, endpoint, doc=doc, access=access,
                    overrides=control)
    return out.routes
