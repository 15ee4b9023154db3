"""DJL Serving / SageMaker routes.

Data plane (`data_routes`): GET|POST /ping, POST /predictions/{model}[/{version}] and POST
/invocations, whose `messages` and `prompt` bodies OpenAI's routes claim (the gateway dispatches
by body keys; DJL's adapter selectors apply to every shape: `protocols/common/sagemaker.py`).
`{model}` is a served base-model name or a DJL workflow name (an alias of its adapter). Answers
are in LMI's async-mode schema, or its rolling-batch one with `option.rolling_batch=vllm`
(`responses.py`).

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
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from protocols.common import sagemaker
from protocols.djl import errors, responses, schema, translate
from protocols.djl.options import DjlOptions
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
from server.core.types import Delta, GenerationEvent, Started
from server.http import jsonio
from server.http.body import JsonResponse, decode_json, parse_model, read_body, request_id_header
from server.http.context import ProtocolContext, current_request_id, options_of
from server.http.disconnect import until_disconnect
from server.http.routes import (
    DATA,
    MANAGEMENT,
    Access,
    Answer,
    Doc,
    Endpoint,
    Route,
    RouteList,
)
from server.http.streaming import EventStreamAnswer

NAME = "djl"
JSONLINES = "application/jsonlines"
ALIAS_HEADER = "x-amzn-sagemaker-adapter-alias"
ALL_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]
_PING_TIMEOUT_S = 5.0


# ---- data plane ------------------------------------------------------------------------------


def routes(ctx: ProtocolContext) -> list[Route]:
    out = RouteList(owner=NAME, render=errors.render)
    health = ping(ctx)
    out.get("/ping", health, access=Access.OPEN, doc=Doc(summary="Health (open)"))
    out.post("/ping", health, access=Access.OPEN, doc=Doc(summary="Health (open)"))
    predict = predictions(ctx)
    for path in ("/predictions/{model}", "/predictions/{model}/{version}"):
        out.post(path, predict, doc=Doc(summary="LMI inference", body=LmiRequest,
                                        query=("adapter",), streams=True))
    out.post("/invocations", invocations(ctx),
             doc=Doc(summary="SageMaker: LMI (`inputs`)", body=LmiRequest, streams=True))
    return out.routes + management_routes(ctx)


def ping(ctx: ProtocolContext) -> Endpoint:
    """DJL's worker status `{"<model>": {"status": "Healthy"}}`: 200 when serving, 503 while
    starting or draining, 500 when the engine failed (DJL's `hasFailure`)."""

    async def endpoint(request: Request) -> Answer:
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
        await asyncio.wait_for(ctx.service.check_health(), _PING_TIMEOUT_S)
    except (GatewayError, TimeoutError):
        return 500, "FAILED"
    return 200, "Healthy"


def predictions(ctx: ProtocolContext) -> Endpoint:
    """LMI inference on `/predictions/{model}`: the base model or a workflow."""

    legacy = options_of(DjlOptions, ctx).legacy_rolling_batch

    async def endpoint(request: Request) -> Answer:
        return await _infer(ctx, request, legacy=legacy)

    return endpoint


def invocations(ctx: ProtocolContext) -> Endpoint:
    """SageMaker `/invocations` with an LMI body; `?model_name=` may name a workflow."""

    legacy = options_of(DjlOptions, ctx).legacy_rolling_batch

    async def endpoint(request: Request) -> Answer:
        return await _infer(ctx, request, legacy=legacy)

    return endpoint


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


async def _infer(ctx: ProtocolContext, request: Request, *, legacy: bool) -> Answer:
    chosen = sagemaker.selectors(request, ctx.service)
    body = parse_model(LmiRequest, decode_json(await read_body(request, ctx.max_body_bytes)))
    texts = translate.input_texts(body, ctx.bounds)
    models = _adapters(ctx, chosen.names(len(texts), body.adapters) or [""] * len(texts))
    plan = translate.to_plan(
        body,
        request_id=request_id_header(request) or current_request_id(),
        models=models,
        bounds=ctx.bounds,
        defaults=ctx.service.defaults(),
        legacy=legacy,
    )
    service = ctx.service
    if plan.stream:
        stream = await _registered(service.start(plan.requests[0]))
        return EventStreamAnswer(stream, _Lines(plan), media_type=JSONLINES)
    work = (
        service.generate(plan.requests[0])
        if len(plan.requests) == 1
        else service.generate_batch(plan.requests)
    )
    result = await _registered(until_disconnect(request, work))
    texts_of_prompts = [
        service.token_texts(list(started.prompt_token_ids)) for started in result.prompts
    ] if plan.prefill else []
    return JsonResponse(jsonio.dumps(responses.to_response(result, plan, texts_of_prompts)))


def _adapters(ctx: ProtocolContext, names: list[str]) -> list[str]:
    """DJL's answer for a name that is no adapter (or workflow): djl_python's 424."""
    for name in names:
        if name and name not in ctx.service.adapters:
            raise AdapterNotFound(f"Adapter {name} is not registered", param="adapters")
    return names


class _Lines:
    """LMI's stream: one JSON line per token; an error as the schema's error line."""

    def __init__(self, plan: translate.Plan) -> None:
        self._encoder = responses.StreamEncoder(plan)

    def encode(self, event: GenerationEvent) -> bytes:
        if isinstance(event, Delta):
            return self._encoder.encode(event)
        if isinstance(event, Started):
            self._encoder.started(event)
        return b""

    def error(self, exc: GatewayError) -> bytes:
        status, _ = errors.inference_error(exc)
        return self._encoder.error(exc.message, status)

    def end(self) -> bytes:
        return b""


# ---- management plane: adapters ----------------------------------------------------------------


def management_routes(ctx: ProtocolContext) -> list[Route]:
    """DJL's adapter API, with and without the model prefix; on the data listener too, where
    DJL and SageMaker clients call it. Every method reaches the endpoint (DJL answers its own
    405)."""
    out = RouteList(
        owner=NAME, render=errors.render_management, access=Access.ADMIN,
        listeners=frozenset({DATA, MANAGEMENT}),
    )
    collection, item, update = adapters(ctx), adapter(ctx), adapter_update(ctx)
    form = ("name", "src", "preload", "pin")
    docs: dict[tuple[str, str], Doc] = {
        ("GET", ""): Doc(summary="List adapters", query=("limit", "next_page_token")),
        ("POST", ""): Doc(summary="Register an adapter", body=schema.AdapterForm, query=form),
        ("GET", "/{name}"): Doc(summary="Describe an adapter"),
        ("DELETE", "/{name}"): Doc(summary="Unregister an adapter"),
        ("POST", "/{name}/update"): Doc(summary="Update an adapter", body=schema.AdapterForm,
                                        query=("src", "preload", "pin")),
    }
    for prefix in ("/models/{model}", ""):
        for suffix, endpoint in (("", collection), ("/{name}", item), ("/{name}/update", update)):
            for method in ALL_METHODS:
                path = f"{prefix}/adapters{suffix}"
                out.add(method, path, endpoint, doc=docs.get((method, suffix)))
    return out.routes


def _methods(**handlers: Callable[[Request], Any]) -> Endpoint:
    """One endpoint for a path; other methods get DJL's 405."""

    async def endpoint(request: Request) -> Answer:
        handler = handlers.get(request.method.lower())
        if handler is None:
            raise errors.MethodNotAllowed()
        response: Response = await handler(request)
        return response

    return endpoint


def adapters(ctx: ProtocolContext) -> Endpoint:
    async def list_adapters(request: Request) -> Response:
        registry = _registry(ctx, request)
        await registry.refresh()
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
        await registry.refresh()
        name = request.path_params["name"]
        failure = registry.failures().get(name)
        if failure is not None and name not in registry.names():
            return _djl_response(translate.describe_failed(name, failure))
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
