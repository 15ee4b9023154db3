"""OpenAI routes as vLLM serves them: completions, chat, models, runtime LoRA, tokenizer, version.

Each endpoint parses, translates, calls the service and encodes; errors render through
`errors.render` before the first byte and in-band (`data: {"error": ...}` + `[DONE]`) after it.
`chat_completions`, `completions` and `tokenize` are also used by server/gateway.py for the
shared `/invocations` and `/tokenize` paths.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from protocols._common.context import ProtocolContext
from protocols._common.disconnect import while_connected
from protocols._common.guard import Endpoint, guarded
from protocols._common.http import (
    ADMIN_KEY,
    json_response,
    parse_model,
    read_json,
    request_id_header,
)
from protocols._common.lookahead import with_ends
from protocols._common.streaming import StreamResponse
from protocols.openai_v1 import errors, schema, translate
from server.core.errors import (
    AdapterExists,
    AdapterInvalid,
    AdapterNotFound,
    EngineError,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
)
from server.core.service import InferenceService
from server.core.types import (
    ChatPrompt,
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
    TextPrompt,
)

logger = logging.getLogger("gateway.openai")
ModelT = TypeVar("ModelT", bound=BaseModel)
ResultT = TypeVar("ResultT")
Encode = Callable[[translate.StreamItem], bytes]
SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"  # as vLLM's StreamingResponse
ADAPTER_HEADER = "x-amzn-sagemaker-adapter-identifier"


def data_routes(ctx: ProtocolContext) -> list[BaseRoute]:
    """The inference listener. vLLM serves its runtime LoRA routes here too (one port)."""
    return [
        Route("/v1/chat/completions", chat_completions(ctx), methods=["POST"]),
        Route("/v1/completions", completions(ctx), methods=["POST"]),
        Route("/v1/models", list_models(ctx), methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model(ctx), methods=["GET"]),
        Route("/detokenize", detokenize(ctx), methods=["POST"]),
        Route("/version", version(ctx), methods=["GET"]),
        *management_routes(ctx),
    ]


def management_routes(ctx: ProtocolContext) -> list[BaseRoute]:
    """vLLM's runtime LoRA routes; absent (404) unless runtime adapter updates are allowed."""
    if not ctx.allow_runtime_lora:
        return []
    return [
        Route("/v1/load_lora_adapter", load_lora_adapter(ctx), methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter(ctx), methods=["POST"]),
    ]


# ---- generation ------------------------------------------------------------------------------


def chat_completions(ctx: ProtocolContext) -> Endpoint:
    service = ctx.service

    @guarded(errors.render)
    async def create_chat_completion(request: Request) -> Response:
        body = _with_adapter_header(
            request, await _body(request, ctx, schema.ChatCompletionRequest)
        )
        gen = translate.chat_request(body, request_id=_request_id(request, body), bounds=ctx.bounds)
        view = translate.ChatView.of(body, _meta(service, "chatcmpl", gen))
        if gen.stream:
            stream = await service.start(gen)
            return await _sse_response(stream, translate.ChatStreamEncoder(view).encode)
        result = await while_connected(request, service.generate(gen))
        return json_response(translate.chat_response(result, view))

    return create_chat_completion


def completions(ctx: ProtocolContext) -> Endpoint:
    service = ctx.service

    @guarded(errors.render)
    async def create_completion(request: Request) -> Response:
        body = _with_adapter_header(request, await _body(request, ctx, schema.CompletionRequest))
        gens = translate.completion_requests(
            body, request_id=_request_id(request, body), bounds=ctx.bounds
        )
        view = await _completion_view(service, body, gens)
        if body.stream:
            events = await _start(service, gens)
            return await _sse_response(events, translate.CompletionStreamEncoder(view).encode)
        result = await while_connected(request, _generate(service, gens))
        return json_response(translate.completion_response(result, view))

    return create_completion


async def _completion_view(
    service: InferenceService, body: schema.CompletionRequest, gens: list[GenerationRequest]
) -> translate.CompletionView:
    token_texts = service.engine.token_texts
    prompts = [g.prompt for g in gens] if body.echo else []
    view = translate.CompletionView.of(
        body, _meta(service, "cmpl", gens[0]), prompts=prompts, token_texts=token_texts
    )
    if len(gens) > 1 and view.usage.continuous:
        # A batch stream reports only the first prompt's tokens; count the others here.
        view = replace(view, prompt_counts=tuple(await _count_prompts(service, gens)))
    return view


async def _count_prompts(service: InferenceService, gens: list[GenerationRequest]) -> list[int]:
    counts = []
    for gen in gens:
        prompt = gen.prompt
        if isinstance(prompt, TextPrompt):
            ids = await service.engine.tokenize(
                prompt.text, add_special_tokens=prompt.add_special_tokens
            )
            counts.append(len(ids))
        else:
            counts.append(len(getattr(prompt, "token_ids", ())))
    return counts


async def _start(
    service: InferenceService, gens: Sequence[GenerationRequest]
) -> AsyncIterator[GenerationEvent]:
    if len(gens) == 1:
        return await service.start(gens[0])
    return await service.start_batch(gens)


async def _generate(
    service: InferenceService, gens: Sequence[GenerationRequest]
) -> GenerationResult:
    if len(gens) == 1:
        return await service.generate(gens[0])
    return await service.generate_batch(gens)


async def _sse_response(events: AsyncIterator[GenerationEvent], encode: Encode) -> Response:
    """Start the SSE body before answering, so that closing it (even before its first chunk,
    when the client is already gone) always reaches its `finally` and aborts the engine."""
    try:
        first = await anext(events)
    except BaseException:
        await _aclose(events)
        raise
    body = _sse(first, events, encode)
    await anext(body)
    return cast(Response, StreamResponse(body, media_type=SSE_MEDIA_TYPE))


async def _sse(
    first: GenerationEvent, events: AsyncIterator[GenerationEvent], encode: Encode
) -> AsyncIterator[bytes]:
    paired = with_ends(events)  # a choice's last token and its end go out as one chunk
    try:
        yield b""  # consumed by `_sse_response`
        if chunk := encode(first):
            yield chunk
        async for item in paired:
            if chunk := encode(item):
                yield chunk
    except GatewayError as exc:
        yield errors.stream_error(exc)
        return
    except Exception:
        logger.exception("error while streaming an OpenAI response")
        yield errors.stream_error(EngineError("Internal error while streaming the response"))
        return
    finally:
        await paired.aclose()  # first: it may hold a pending fetch from `events`
        await _aclose(events)
    yield errors.DONE


async def _aclose(events: object) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


# ---- models ------------------------------------------------------------------------------------


def list_models(ctx: ProtocolContext) -> Endpoint:
    service = ctx.service

    @guarded(errors.render)
    async def show_available_models(request: Request) -> Response:
        info = service.engine.info()
        roots = None
        if request.scope.get(ADMIN_KEY, True):  # no auth configured: everyone is admin
            roots = {r.name: r.src for r in service.adapters.records()}
            roots.update(dict.fromkeys(_base_names(service), info.model_path))
        return json_response(
            translate.model_list(
                _base_names(service),
                service.adapters.names(),
                created=ctx.created,
                max_model_len=info.max_model_len,
                roots=roots,
            )
        )

    return show_available_models


def retrieve_model(ctx: ProtocolContext) -> Endpoint:
    service = ctx.service

    @guarded(errors.render)
    async def show_model(request: Request) -> Response:
        name = request.path_params["model"]
        _check_model(service, name)
        parent = None if name in service.base_names else service.served_name
        return json_response(translate.model_object(name, created=ctx.created, parent=parent))

    return show_model


# ---- runtime LoRA --------------------------------------------------------------------------


def load_lora_adapter(ctx: ProtocolContext) -> Endpoint:
    adapters = ctx.service.adapters

    @guarded(errors.render)
    async def load(request: Request) -> Response:
        body = await _body(request, ctx, schema.LoadLoraAdapterRequest)
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise errors.InvalidUserInput("Both 'lora_name' and 'lora_path' must be provided.")
        try:
            if body.load_inplace and name in adapters:
                await adapters.update(name, src=path)
            else:
                await adapters.register(name, path)
        except GatewayError as exc:
            raise _load_error(exc, name, path) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    return load


def _load_error(exc: GatewayError, name: str, path: str) -> GatewayError:
    """vLLM's answers: duplicate or bad name → 400 InvalidUserInput, nothing at the path → 404;
    unusable files → 400 (vLLM answers 500 there, its own tests expect 400)."""
    if isinstance(exc, AdapterExists):
        return errors.InvalidUserInput(
            f"The lora adapter '{name}' has already been loaded. If you want to load the "
            "adapter in place, set 'load_inplace' to True."
        )
    if isinstance(exc, AdapterInvalid):
        if "No adapter found" in exc.message:
            return errors.LoraPathNotFound(
                f"Loading lora {name} failed: No adapter found for {path}"
            )
        return exc
    if type(exc) is InvalidRequest:
        return errors.InvalidUserInput(exc.message)
    return exc


def unload_lora_adapter(ctx: ProtocolContext) -> Endpoint:
    adapters = ctx.service.adapters

    @guarded(errors.render)
    async def unload(request: Request) -> Response:
        name = (await _body(request, ctx, schema.UnloadLoraAdapterRequest)).lora_name
        if not name:
            raise errors.InvalidUserInput(
                "'lora_name' needs to be provided to unload a LoRA adapter."
            )
        try:
            await adapters.unregister(name)  # frees the engine slot once in-flight requests end
        except AdapterNotFound:
            raise AdapterNotFound(
                f"The lora adapter '{name}' cannot be found.", param=None
            ) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return unload


# ---- tokenizer, version --------------------------------------------------------------------


def tokenize(ctx: ProtocolContext) -> Endpoint:
    """vLLM's `/tokenize`: completion form (`prompt`) or chat form (`messages`)."""
    service = ctx.service

    @guarded(errors.render)
    async def tokenize_text(request: Request) -> Response:
        data = await read_json(request, ctx.max_body_bytes, strict_content_type=True)
        body: schema.TokenizeChatRequest | schema.TokenizeCompletionRequest
        text: str | ChatPrompt
        if isinstance(data, dict) and "messages" in data:
            body = _parse(schema.TokenizeChatRequest, data)
            text = translate.chat_prompt(body)
        else:
            body = _parse(schema.TokenizeCompletionRequest, data)
            text = body.prompt
        _check_model(service, body.model)
        ids = await service.engine.tokenize(text, add_special_tokens=body.add_special_tokens)
        strs = service.engine.token_texts(ids) if body.return_token_strs else None
        max_len = service.engine.info().max_model_len
        return json_response(
            translate.tokenize_response(ids, max_model_len=max_len, token_strs=strs)
        )

    return tokenize_text


def detokenize(ctx: ProtocolContext) -> Endpoint:
    service = ctx.service

    @guarded(errors.render)
    async def detokenize_ids(request: Request) -> Response:
        body = await _body(request, ctx, schema.DetokenizeRequest)
        _check_model(service, body.model)
        vocab = service.engine.info().vocab_size
        if any(token >= vocab for token in body.tokens):
            raise InvalidRequest(
                f"Token ids must be below the vocabulary size {vocab}.", param="tokens"
            )
        return json_response({"prompt": "".join(service.engine.token_texts(body.tokens))})

    return detokenize_ids


def version(ctx: ProtocolContext) -> Endpoint:
    @guarded(errors.render)
    async def show_version(request: Request) -> Response:
        return JSONResponse({"version": ctx.service.engine.info().version})

    return show_version


# ---- helpers ------------------------------------------------------------------------------------


async def _body(request: Request, ctx: ProtocolContext, model: type[ModelT]) -> ModelT:
    data = await read_json(request, ctx.max_body_bytes, strict_content_type=True)
    return _parse(model, data)


def _parse(model: type[ModelT], data: Any) -> ModelT:
    """Validation errors name the field as FastAPI does in vLLM: `body.<path>`."""
    try:
        return parse_model(model, data)
    except InvalidRequest as exc:
        param = _clean_param(exc.param)
        raise InvalidRequest(exc.message, param=param and f"body.{param}") from None


def _clean_param(param: str | None) -> str | None:
    """Drop pydantic's union-branch markers (`list[int]`, `str`, …) from an error path."""
    if not param:
        return None
    markers = {"str", "int", "float", "bool", "list", "dict", "none"}
    parts = [p for p in param.split(".") if p not in markers and not any(c in p for c in "[](){}")]
    return ".".join(parts) or None


def _with_adapter_header(request: Request, body: ModelT) -> ModelT:
    """SageMaker `/invocations` names the adapter in a header, which vLLM copies into `model`."""
    adapter = request.headers.get(ADAPTER_HEADER)
    if adapter and request.url.path == "/invocations":
        return body.model_copy(update={"model": adapter})
    return body


def _request_id(request: Request, body: schema.SamplingFields) -> str:
    return request_id_header(request) or body.request_id or uuid.uuid4().hex


def _meta(service: InferenceService, prefix: str, gen: GenerationRequest) -> translate.ReplyMeta:
    model = translate.response_model(gen.model, service.base_names, service.served_name)
    return translate.ReplyMeta(
        id=f"{prefix}-{gen.request_id}", created=int(time.time()), model=model
    )


def _base_names(service: InferenceService) -> list[str]:
    return [service.served_name, *sorted(service.base_names - {service.served_name})]


def _check_model(service: InferenceService, name: str | None) -> None:
    if name and name not in service.base_names and name not in service.adapters:
        raise ModelNotFound(
            f"The model `{name}` does not exist. Valid aliases: "
            f"{', '.join(sorted(service.base_names))}."
        )
