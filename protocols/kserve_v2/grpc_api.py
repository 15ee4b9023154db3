"""Triton's `inference.GRPCInferenceService` over gRPC, on the same translation as the HTTP
routes (tensors, sampling knobs, model resolution, statistics).

The stubs are the ones `tritonclient` ships (generated from Triton's .proto files). Every served
model is the vLLM backend's decoupled model: `ModelStreamInfer` sends one response per engine
delta when the `stream` input is true, the last one carrying the parameter
`triton_final_response: true` (every response carries it, as Triton does for decoupled models),
or one whole response (prompt prepended unless `exclude_input_in_output`) when it is not. Errors
inside a stream are `error_message` responses and the stream stays open (a refused request's
carries only its id; one that failed while generating also its model and the final flag, as a
backend error response); a unary call's errors are gRPC status codes (`errors.GRPC_STATUS`).
`ModelInfer` answers a non-streamed request as the HTTP `/infer` route does (Triton refuses it
for decoupled models; here it simply works).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from protocols.kserve_v2 import errors, tensors
from protocols.kserve_v2.models import (
    MODEL_VERSION,
    OUTPUTS,
    ModelRef,
    model_config,
    model_metadata,
    repository_index,
    resolve_model,
    served_model_names,
    server_metadata,
)
from protocols.kserve_v2.routes import target_for
from protocols.kserve_v2.schema import InferInput, RequestedOutput
from protocols.kserve_v2.schema import InferRequest as WireRequest
from protocols.kserve_v2.stats import InferenceStats
from protocols.kserve_v2.tensors import Tensor
from protocols.kserve_v2.translate import (
    OutputPlan,
    StreamFolder,
    TextCall,
    TokenCall,
    check_text_inputs,
    is_token_request,
    select_outputs,
    text_call,
    text_outputs,
    token_call,
    token_outputs,
)
from server.core.collect import collect
from server.core.errors import GatewayError, InvalidRequest, ServiceUnavailable
from server.core.lifecycle import State
from server.core.types import GenerationResult
from server.http.context import ProtocolContext, new_request_id
from server.http.rpc import GrpcService

if TYPE_CHECKING:
    from server.http.rpc import Context

SERVICE = "inference.GRPCInferenceService"
HEALTH_METHODS = frozenset(
    f"/{SERVICE}/{name}" for name in ("ServerLive", "ServerReady", "ModelReady")
)
FINAL = "triton_final_response"
SHUTTING_DOWN = "GRPC server is shutting down and has stopped accepting new requests."
InferRequest = service_pb2.ModelInferRequest
InferResponse = service_pb2.ModelInferResponse
StreamResponse = service_pb2.ModelStreamInferResponse
_OUTPUT_TYPES = {spec.name: spec.datatype for spec in OUTPUTS}


class TritonGrpc(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The servicer. Method names are the proto's (CamelCase)."""

    def __init__(self, ctx: ProtocolContext, stats: InferenceStats) -> None:
        self.ctx = ctx
        self.service = ctx.service
        self.stats = stats

    # ---- health and metadata -------------------------------------------------------------
    async def ServerLive(self, request: Any, context: Context) -> Any:
        return service_pb2.ServerLiveResponse(live=self.service.lifecycle.live)

    async def ServerReady(self, request: Any, context: Context) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.service.lifecycle.accepting)

    async def ModelReady(self, request: Any, context: Context) -> Any:
        """An unknown model is not ready (released Triton answers so, without an error)."""
        try:
            self._model_ref(request.name, request.version)
        except GatewayError:
            return service_pb2.ModelReadyResponse(ready=False)
        return service_pb2.ModelReadyResponse(ready=self.service.lifecycle.accepting)

    async def ServerMetadata(self, request: Any, context: Context) -> Any:
        metadata = server_metadata(self.ctx.server_version)
        return _proto(metadata, service_pb2.ServerMetadataResponse())

    async def ModelMetadata(self, request: Any, context: Context) -> Any:
        model = await self._model(request.name, request.version, context)
        return _proto(model_metadata(model), service_pb2.ModelMetadataResponse())

    async def ModelConfig(self, request: Any, context: Context) -> Any:
        model = await self._model(request.name, request.version, context)
        config = _proto(
            model_config(model, self.service.served_name), model_config_pb2.ModelConfig()
        )
        return service_pb2.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request: Any, context: Context) -> Any:
        if request.name:
            names = [(await self._model(request.name, request.version, context)).name]
        else:
            names = served_model_names(self.service)
        return _proto(
            await self.stats.to_json(names, MODEL_VERSION), service_pb2.ModelStatisticsResponse()
        )

    async def RepositoryIndex(self, request: Any, context: Context) -> Any:
        index = repository_index(
            served_model_names(self.service), accepting=self.service.lifecycle.accepting,
            ready_only=request.ready,
        )
        return service_pb2.RepositoryIndexResponse(
            models=[service_pb2.RepositoryIndexResponse.ModelIndex(**entry) for entry in index]
        )

    # ---- inference -------------------------------------------------------------------------
    async def ModelInfer(self, request: Any, context: Context) -> Any:
        model = await self._model(request.model_name, request.model_version, context)
        timer = self.stats.timer(model.name)
        try:
            call = self._call(request, model, route="infer")
            timer.mark()
            result = await self._generate(call)
            timer.mark()
        except GatewayError as exc:
            timer.failure()
            await _abort(context, self._as_triton(exc))
        except BaseException:
            timer.failure()
            raise
        timer.success()
        if isinstance(call, TextCall):
            produced = text_outputs(result, call)
        else:
            produced = token_outputs(result, call)
        return _response(model, request.id, _requested(produced, request))

    async def ModelStreamInfer(
        self, requests: AsyncIterator[Any], context: Context
    ) -> AsyncIterator[Any]:
        """Every request on the stream runs concurrently; their responses interleave."""
        out: asyncio.Queue[Any] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()

        async def read() -> None:
            async for request in requests:
                task = asyncio.create_task(self._stream_one(request, out))
                running.add(task)
                task.add_done_callback(running.discard)
            while running:
                await asyncio.gather(*list(running), return_exceptions=True)
            await out.put(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await out.get()) is not None:
                yield item
            await reader
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(reader, *running, return_exceptions=True)

    async def _stream_one(self, request: Any, out: asyncio.Queue[Any]) -> None:
        """One request of a stream: its responses, or one `error_message` response."""
        try:
            model = self._model_ref(request.model_name, request.model_version)
        except GatewayError as exc:
            await out.put(_refused(request, exc))
            return
        timer = self.stats.timer(model.name)
        try:
            call = self._call(request, model, route="generate_stream")
            if not isinstance(call, TextCall):
                raise InvalidRequest("token-id requests are served by ModelInfer only")
            timer.mark()
            stream = await self.service.start(call.request)
            timer.mark()
        except GatewayError as exc:
            timer.failure()
            await out.put(_refused(request, self._as_triton(exc)))
            return
        ok = False
        try:
            async for response in _responses(stream, call, model, request):
                await out.put(response)
            ok = True
        except GatewayError as exc:
            await out.put(_failed(request, exc))
        finally:
            await stream.aclose()
            timer.finished(ok)

    # ---- helpers -----------------------------------------------------------------------------
    def _as_triton(self, exc: GatewayError) -> GatewayError:
        """A request refused because the server stops gets Triton's own words."""
        if isinstance(exc, ServiceUnavailable) and self.service.lifecycle.state is State.DRAINING:
            return ServiceUnavailable(SHUTTING_DOWN)
        return exc

    def _model_ref(self, name: str, version: str) -> ModelRef:
        return resolve_model(
            name, version or None, base_names=self.service.base_names,
            adapters=self.service.adapters,
        )

    async def _model(self, name: str, version: str, context: Context) -> ModelRef:
        try:
            return self._model_ref(name, version)
        except GatewayError as exc:
            await _abort(context, exc)
            raise  # unreachable: abort raises

    def _call(self, request: Any, model: ModelRef, *, route: str) -> TextCall | TokenCall:
        inputs = decode_inputs(request)
        params = request_parameters(request.parameters)
        target = target_for(
            self.ctx, model, request_id=request.id or f"kserve-{new_request_id()}",
            client_id=request.id,
        )
        requested = tuple(o.name for o in request.outputs) or None
        if route == "infer" and is_token_request(inputs):
            return token_call(_wire_for_tokens(request), inputs[0], target, params)
        return text_call(
            check_text_inputs(inputs, model.name), params, target,
            route="infer" if route == "infer" else "generate_stream", requested=requested,
        )

    async def _generate(self, call: TextCall | TokenCall) -> GenerationResult:
        stream = await self.service.start(call.request)
        try:
            return await collect(stream, request_id=call.request.request_id, model="")
        finally:
            await stream.aclose()


async def _responses(
    stream: Any, call: TextCall, model: ModelRef, request: Any
) -> AsyncIterator[Any]:
    """The responses of one streamed request, as the vLLM backend sends them: the final flag
    rides on the last real response, so there is never an empty final one (a request's
    `triton_enable_empty_final_response` changes nothing, as with the backend)."""
    if not call.stream:
        result = await collect(stream, request_id=call.request.request_id, model="")
        outputs = _requested(text_outputs(result, call), request)
        yield _stream_response(model, request.id, outputs, final=True)
        return
    folder = StreamFolder(call, {})
    async for event in stream:
        folded = folder.fold(event)
        if folded is not None:
            yield _delta_response(model, request, folded)
    last = folder.close()
    if last is not None:
        yield _delta_response(model, request, last)


def _proto(data: dict[str, Any], message: Any) -> Any:
    """The HTTP route's JSON (Triton's JSON form of the same message) as the proto message;
    a field the installed stubs predate is left out."""
    return json_format.ParseDict(data, message, ignore_unknown_fields=True)


def _refused(request: Any, exc: GatewayError) -> Any:
    """A request refused before it started: the message and the request's id only."""
    return StreamResponse(error_message=exc.message, infer_response=InferResponse(id=request.id))


def _failed(request: Any, exc: GatewayError) -> Any:
    """A request that failed while generating: as the backend's error response, final."""
    response = InferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    response.parameters[FINAL].bool_param = True
    return StreamResponse(error_message=exc.message, infer_response=response)


def _delta_response(model: ModelRef, request: Any, folded: Mapping[str, Any]) -> Any:
    produced = [
        _tensor(name, folded[name]) for name in _OUTPUT_TYPES if name in folded
    ]
    return _stream_response(model, request.id, _requested(produced, request),
                            final=bool(folded.get("done")))


def _tensor(name: str, value: Any) -> Tensor:
    dtype = _OUTPUT_TYPES[name]
    if dtype == "BYTES":
        item = value.encode() if isinstance(value, str) else value
        return Tensor(name, dtype, (1,), (item,))
    return Tensor(name, dtype, (1,), (value,))


def _requested(produced: Iterable[Tensor], request: Any) -> list[Tensor]:
    """The outputs the request names (in its order), else all produced."""
    names = tuple(dict.fromkeys(o.name for o in request.outputs)) or None
    return select_outputs(list(produced), OutputPlan(names, frozenset(), False))[0]


def _response(model: ModelRef, request_id: str, outputs: Iterable[Tensor]) -> Any:
    response = InferResponse(model_name=model.name, model_version=MODEL_VERSION, id=request_id)
    for tensor in outputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.append(tensors.to_binary(tensor))
    return response


def _stream_response(
    model: ModelRef, request_id: str, outputs: Iterable[Tensor], *, final: bool
) -> Any:
    response = _response(model, request_id, outputs)
    response.parameters[FINAL].bool_param = final
    return StreamResponse(infer_response=response)


# ---- wire → tensors and parameters --------------------------------------------------------
_CONTENTS = {
    "bool": "bool_contents", "uint": "uint_contents", "int": "int_contents",
    "float": "fp32_contents", "bytes": "bytes_contents",
}
_WIDE = {"UINT64": "uint64_contents", "INT64": "int64_contents", "FP64": "fp64_contents"}


def decode_inputs(request: Any) -> list[Tensor]:
    """Input tensors from `raw_input_contents` (all inputs or none, as Triton) or `contents`."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequest(
            f"expected {len(request.inputs)} inputs in raw_input_contents but got {len(raw)}"
        )
    typed = [item.name for item in request.inputs if item.HasField("contents")]
    if raw and typed:
        raise InvalidRequest(
            "contents field must not be specified when using raw_input_contents for input "
            f"'{typed[0]}' for model '{request.model_name}'"
        )
    decoded: list[Tensor] = []
    for index, item in enumerate(request.inputs):
        dtype = tensors.datatype(item.datatype, item.name)
        shape = tuple(item.shape)
        if any(dim < 0 for dim in shape):
            raise InvalidRequest(f"unexpected shape for input '{item.name}': {list(shape)}")
        if raw:
            decoded.append(tensors.from_binary(item.name, dtype, shape, raw[index]))
            continue
        field = _WIDE.get(dtype.name) or _CONTENTS[dtype.kind]
        values = list(getattr(item.contents, field))
        if dtype.kind == "bytes":
            values = [_utf8(item.name, v) for v in values]
        decoded.append(tensors.from_json(item.name, dtype, shape, values))
    return decoded


def _utf8(name: str, value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise InvalidRequest(f"input '{name}' is not valid UTF-8") from None


def request_parameters(parameters: Mapping[str, Any]) -> dict[str, object]:
    """`InferParameter`s as plain values (Triton's own `triton_*` keys included: the knob
    reader skips them)."""
    values: dict[str, object] = {}
    for key, parameter in parameters.items():
        which = parameter.WhichOneof("parameter_choice")
        if which is not None:
            values[key] = getattr(parameter, which)
    return values


def _wire_for_tokens(request: Any) -> Any:
    """The HTTP schema's view of a token-id request (per-input parameters, requested outputs)."""
    first = request.inputs[0]
    return WireRequest(
        id=request.id or None,
        inputs=[InferInput(name=first.name, shape=list(first.shape), datatype=first.datatype,
                           parameters=request_parameters(first.parameters))],
        outputs=[RequestedOutput(name=o.name) for o in request.outputs] or None,
    )


async def _abort(context: Context, exc: GatewayError) -> None:
    await context.abort(errors.grpc_status(exc), exc.message)


def services(ctx: ProtocolContext, stats: InferenceStats) -> list[GrpcService]:
    servicer = TritonGrpc(ctx, stats)
    return [
        GrpcService(
            name=SERVICE,
            owner="kserve",
            add_to=lambda server: service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
                servicer, server
            ),
            open_methods=HEALTH_METHODS,
        )
    ]

