"""DJL Serving / SageMaker routes.

Data plane (`data_routes`): GET|POST /ping, POST /predictions/{model}[/{version}]; `invocations`
serves the DJL bodies of the shared POST /invocations (the gateway dispatches by body keys).
`{model}` is a served base-model name or a DJL workflow name (an alias of its adapter).

Management plane (`management_routes`): DJL's adapter API on /models/{model}/adapters… and the
prefix-less /adapters… (there is one base model, so the prefix is always optional), which also
serves vLLM's SageMaker `POST /adapters` and `DELETE /adapters/{name}`:
- parameters come from the query string (DJL) and/or a JSON body {name, src, preload, pin, …}
  (SageMaker); a key present in both takes the query's value;
- success is DJL's `{"status": "Adapter a1 registered"}` (pretty JSON), except that a register
  sent with a JSON body and without `Accept: application/json` gets vLLM's plain text
  `Adapter a1 registered`; DELETE always answers DJL's JSON (its `status` holds vLLM's text).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from protocols._common import jsonio
from protocols._common.context import ProtocolContext
from protocols._common.disconnect import while_connected
from protocols._common.guard import Endpoint, guarded
from protocols._common.http import decode_json, parse_model, read_body, request_id_header
from protocols._common.lookahead import with_ends
from protocols._common.streaming import StreamResponse
from protocols.djl import errors, translate
from protocols.djl.schema import LmiRequest
from server.core.adapters import AdapterRecord, AdapterRegistry
from server.core.errors import (
    AdapterNotFound,
    GatewayError,
    InvalidRequest,
    LoraDisabled,
    ModelNotFound,
)
from server.core.lifecycle import State
from server.core.service import EventStream
from server.core.types import ChoiceEnd, Delta

JSONLINES = "application/jsonlines"
ALIAS_HEADER = "x-amzn-sagemaker-adapter-alias"
ALL_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]
_PING_TIMEOUT_S = 5.0


# ---- data plane ------------------------------------------------------------------------------


def data_routes(ctx: ProtocolContext) -> list[BaseRoute]:
    predict = predictions(ctx)
    return [
        Route("/ping", ping(ctx), methods=["GET", "POST"]),
        Route("/predictions/{model}", predict, methods=["POST"]),
        Route("/predictions/{model}/{version}", predict, methods=["POST"]),
    ]


def ping(ctx: ProtocolContext) -> Endpoint:
    """DJL's worker status `{"<model>": {"status": "Healthy"}}`: 200 when serving, 503 while
    starting or draining, 500 when the engine failed (DJL's `hasFailure`)."""

    async def endpoint(request: Request) -> Response:
        status, state = await _health(ctx)
        names = [ctx.service.served_name, *ctx.service.adapters.aliases()]
        return _djl_response({name: {"status": state} for name in names}, status)

    return endpoint


async def _health(ctx: ProtocolContext) -> tuple[int, str]:
    lifecycle = ctx.service.lifecycle
    if lifecycle.state is State.FAILED:
        return 500, "FAILED"
    if not lifecycle.accepting:
        return 503, "Unhealthy"
    try:
        await asyncio.wait_for(ctx.service.engine.check_health(), _PING_TIMEOUT_S)
    except (GatewayError, TimeoutError):
        return 500, "FAILED"
    return 200, "Healthy"


def predictions(ctx: ProtocolContext) -> Endpoint:
    @guarded(errors.render)
    async def endpoint(request: Request) -> Response:
        return await _infer(ctx, request, _target(ctx, request.path_params["model"]))

    return endpoint


def invocations(ctx: ProtocolContext) -> Endpoint:
    """SageMaker `/invocations` with an LMI body; `?model_name=` may name a workflow."""

    @guarded(errors.render)
    async def endpoint(request: Request) -> Response:
        model = request.query_params.get("model_name")
        return await _infer(ctx, request, _target(ctx, model) if model else None)

    return endpoint


def _target(ctx: ProtocolContext, model: str) -> str | None:
    """A model in the path: None for the base model, the workflow name for a workflow."""
    service = ctx.service
    if model in service.base_names:
        return None
    if model in service.adapters.aliases():
        return model
    raise ModelNotFound(f"Model or workflow not found: {model}", param=None)


T = TypeVar("T")


async def _registered(work: Awaitable[T]) -> T:
    """An adapter unregistered between our check and the engine is DJL's 424, not a 404."""
    try:
        return await work
    except ModelNotFound as exc:
        if isinstance(exc, AdapterNotFound):
            raise
        raise AdapterNotFound(
            f"Adapter is not registered: {exc.message}", param="adapters"
        ) from None


async def _infer(ctx: ProtocolContext, request: Request, workflow: str | None) -> Response:
    body = parse_model(LmiRequest, decode_json(await read_body(request, ctx.max_body_bytes)))
    texts = translate.input_texts(body, ctx.bounds)
    models = [workflow] * len(texts) if workflow else _adapters(ctx, request, body, len(texts))
    plan = translate.to_plan(
        body,
        request_id=request_id_header(request) or uuid.uuid4().hex,
        models=models,
        bounds=ctx.bounds,
    )
    if plan.stream:
        stream = await _registered(ctx.service.start(plan.requests[0]))
        lines = _lines(stream, translate.StreamEncoder(plan))
        return cast(Response, StreamResponse(lines, media_type=JSONLINES))
    service = ctx.service
    work = (
        service.generate(plan.requests[0])
        if len(plan.requests) == 1
        else service.generate_batch(plan.requests)
    )
    result = await _registered(while_connected(request, work))
    texts_of_prompt: list[str] = []
    if plan.prefill:
        texts_of_prompt = ctx.service.engine.token_texts(list(result.prompt.prompt_token_ids))
    return Response(
        jsonio.dumps(translate.to_response(result, plan, texts_of_prompt)),
        media_type=errors.JSON,
    )


def _adapters(ctx: ProtocolContext, request: Request, body: LmiRequest, count: int) -> list[str]:
    headers = request.headers
    selectors = translate.Selectors(
        query=request.query_params.get("adapter"),
        custom_attributes=translate.custom_attribute_adapter(
            headers.get("x-amzn-sagemaker-custom-attributes")
        ),
        header=headers.get("x-amzn-sagemaker-adapter-identifier"),
    )
    names = translate.select_adapters(body, selectors, count)
    for name in names:
        if name and name not in ctx.service.adapters:
            raise AdapterNotFound(f"Adapter {name} is not registered", param="adapters")
    return names


async def _lines(stream: EventStream, encoder: translate.StreamEncoder) -> AsyncIterator[bytes]:
    try:
        async for item in with_ends(stream):
            if isinstance(item, tuple):
                yield b"".join(encoder.lines(*item))
            elif isinstance(item, Delta):
                yield b"".join(encoder.lines(item, None))
            elif isinstance(item, ChoiceEnd):
                yield encoder.end_only(item)
    except GatewayError as exc:
        status, _ = errors.inference_error(exc)
        yield encoder.error(exc.message, status)
    finally:
        await stream.aclose()


# ---- management plane: adapters ----------------------------------------------------------------


def management_routes(ctx: ProtocolContext) -> list[BaseRoute]:
    collection, item, update = adapters(ctx), adapter(ctx), adapter_update(ctx)
    routes: list[BaseRoute] = []
    for prefix in ("/models/{model}", ""):
        routes += [
            Route(f"{prefix}/adapters", collection, methods=ALL_METHODS),
            Route(f"{prefix}/adapters/{{name}}", item, methods=ALL_METHODS),
            Route(f"{prefix}/adapters/{{name}}/update", update, methods=ALL_METHODS),
        ]
    return routes


def _methods(**handlers: Callable[[Request], Any]) -> Endpoint:
    """One endpoint for a path; other methods get DJL's 405."""

    @guarded(errors.render_management)
    async def endpoint(request: Request) -> Response:
        handler = handlers.get(request.method.lower())
        if handler is None:
            raise errors.MethodNotAllowed()
        response: Response = await handler(request)
        return response

    return endpoint


def adapters(ctx: ProtocolContext) -> Endpoint:
    async def list_adapters(request: Request) -> Response:
        registry = _registry(ctx, request)
        query = dict(request.query_params)
        return _djl_response(translate.to_list(registry.records(), query))

    async def register(request: Request) -> Response:
        registry = _registry(ctx, request)
        body = await _optional_body(ctx, request)
        form = translate.to_registration(translate.to_form(_query(request), body))
        record = await registry.register(
            form.name,
            form.src,
            preload=form.preload,
            pin=form.pin,
            options=form.options,
            alias=request.headers.get(ALIAS_HEADER),
        )
        message = f"Adapter {record.display_name} registered"
        if body is not None and "application/json" not in request.headers.get("accept", ""):
            return PlainTextResponse(message)
        return _djl_response(translate.status(message))

    return _methods(get=list_adapters, post=register)


def adapter(ctx: ProtocolContext) -> Endpoint:
    async def describe(request: Request) -> Response:
        registry = _registry(ctx, request)
        record = _record(registry, request)
        loaded = record.name in await registry.engine_resident()
        return _djl_response(translate.describe(record, engine_loaded=loaded))

    async def unregister(request: Request) -> Response:
        registry = _registry(ctx, request)
        record = _record(registry, request)
        await registry.unregister(record.name)
        return _djl_response(translate.status(f"Adapter {_shown(record, request)} unregistered"))

    return _methods(get=describe, delete=unregister)


def adapter_update(ctx: ProtocolContext) -> Endpoint:
    async def update(request: Request) -> Response:
        registry = _registry(ctx, request)
        record = _record(registry, request)
        body = await _optional_body(ctx, request)
        form = translate.to_update(translate.to_form(_query(request), body))
        record = await registry.update(
            record.name, src=form.src, preload=form.preload, pin=form.pin, options=form.options
        )
        record.alias = request.headers.get(ALIAS_HEADER) or record.alias
        return _djl_response(translate.status(f"Adapter {record.display_name} updated"))

    return _methods(post=update)


def _registry(ctx: ProtocolContext, request: Request) -> AdapterRegistry:
    """The registry of the model in the path (there is one base model)."""
    model = request.path_params.get("model")
    if model is not None and model not in ctx.service.base_names:
        raise ModelNotFound(f"The model {model} was not found", param=None)
    registry = ctx.service.adapters
    if not registry.limits.enabled:
        raise LoraDisabled("LoRA is not enabled.")
    return registry


def _record(registry: AdapterRegistry, request: Request) -> AdapterRecord:
    name = request.path_params["name"]
    if name not in registry.names():
        shown = request.headers.get(ALIAS_HEADER) or name
        raise AdapterNotFound(f"The adapter {shown} was not found", param="name")
    return registry.get(name)


def _shown(record: AdapterRecord, request: Request) -> str:
    return request.headers.get(ALIAS_HEADER) or record.display_name


def _query(request: Request) -> dict[str, str]:
    """Query parameters with exactly one value (DJL ignores repeated ones)."""
    counts: dict[str, list[str]] = {}
    for key, value in request.query_params.multi_items():
        counts.setdefault(key, []).append(value)
    return {key: values[0] for key, values in counts.items() if len(values) == 1}


async def _optional_body(ctx: ProtocolContext, request: Request) -> dict[str, Any] | None:
    """The JSON object body, if any; a body that is not JSON is ignored (vLLM reads the query
    then), a JSON body that is not an object is an error."""
    raw = await read_body(request, ctx.max_body_bytes)
    if not raw.strip():
        return None
    try:
        data = jsonio.loads(raw)
    except jsonio.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object")
    return data


def _djl_response(content: Any, status: int = 200) -> Response:
    return Response(translate.djl_json(content), status, media_type=errors.JSON)
