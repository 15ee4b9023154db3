"""OpenAI routes as vLLM serves them: completions, chat, models, runtime LoRA, tokenizer, version.

Each endpoint parses, translates, calls the service and encodes; errors render through
`errors.render` before the first byte and in-band (`data: {"error": ...}` + `[DONE]`) after it.
Shared paths: SageMaker's `/invocations` and DJL's `/predictions/{model}` with `messages` (chat)
or `prompt` (completions), where DJL's adapter selectors name the model, and vLLM's `/tokenize`
with `prompt` or `messages`; bodies without them go to the other protocols.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse

from protocols.common.chat import response_model
from protocols.common.sagemaker import selectors as sagemaker_selectors
from protocols.common.tools import ChoiceReader
from protocols.openai_v1 import (
    chat_replies,
    completion_replies,
    errors,
    models,
    replies,
    requests,
    responses,
    schema,
    tokenizer,
    tools,
)
from server.core.adapter_records import MERGED_NAME
from server.core.batch import BatchStream
from server.core.engine import OutputParser
from server.core.errors import (
    AdapterExists,
    AdapterNotFound,
    AdapterSourceMissing,
    GatewayError,
    InvalidRequest,
)
from server.core.service import InferenceService
from server.core.stream import EventStream
from server.core.types import ChatPrompt, GenerationEvent, GenerationRequest, GenerationResult
from server.http.body import json_response, read_json, request_id_header
from server.http.context import ADMIN_KEY, ProtocolContext, current_request_id
from server.http.disconnect import until_disconnect
from server.http.router import has_key
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

ModelT = TypeVar("ModelT", bound=BaseModel)
SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"  # as vLLM's StreamingResponse
NAME = "openai"
ChunkEncoder = chat_replies.ChatStreamEncoder | completion_replies.CompletionStreamEncoder
# Shared with DJL's LMI bodies; DJL's adapter selectors apply there (protocols/common/sagemaker.py).
SAGEMAKER_PATHS = ("/invocations", "/predictions/{model}", "/predictions/{model}/{version}")


def routes(ctx: ProtocolContext) -> list[Route]:
    """The inference listener; vLLM serves its runtime LoRA routes there too (one port), and
    the gateway also on the management listener."""
    out = RouteList(owner=NAME, render=errors.render)
    chat, complete = chat_completions(ctx), completions(ctx)
    out.post("/v1/chat/completions", chat,
             doc=Doc(summary="Chat completion", body=schema.ChatCompletionRequest, streams=True))
    out.post("/v1/completions", complete,
             doc=Doc(summary="Completion", body=schema.CompletionRequest, streams=True))
    sm_chat, sm_complete = chat_completions(ctx, sagemaker=True), completions(ctx, sagemaker=True)
    for path in SAGEMAKER_PATHS:
        out.post(path, sm_chat, claim=has_key("messages"),
                 doc=Doc(summary="SageMaker / DJL: chat (`messages`)",
                         body=schema.ChatCompletionRequest, streams=True))
        out.post(path, sm_complete, claim=has_key("prompt"),
                 doc=Doc(summary="SageMaker / DJL: completion (`prompt`)",
                         body=schema.CompletionRequest, streams=True))
    store = responses.ResponseStore(peers=ctx.service.peers)
    out.post("/v1/responses", create_response(ctx, store),
             doc=Doc(summary="Responses API", body=schema.ResponsesRequest, streams=True))
    out.get("/v1/responses/{response_id}", retrieve_response(store),
            doc=Doc(summary="A stored response"))
    out.post("/v1/responses/{response_id}/cancel", cancel_response(store),
             doc=Doc(summary="Cancel a background response"))
    out.get("/v1/models", list_models(ctx), doc=Doc(summary="Served models and adapters"))
    out.get("/v1/models/{model:path}", retrieve_model(ctx), doc=Doc(summary="One model"))
    out.post("/tokenize", tokenize(ctx), claim=_tokenize_body,
             doc=Doc(summary="vLLM tokenize (`prompt` or `messages`)",
                     body=(schema.TokenizeCompletionRequest, schema.TokenizeChatRequest)))
    out.post("/detokenize", detokenize(ctx),
             doc=Doc(summary="Token ids to text", body=schema.DetokenizeRequest))
    out.get("/version", version(ctx), doc=Doc(summary="Server version"))
    if ctx.allow_runtime_lora:  # absent (404) unless runtime adapter updates are allowed
        both, admin = frozenset({DATA, MANAGEMENT}), Access.ADMIN
        out.post("/v1/load_lora_adapter", load_lora_adapter(ctx), listeners=both, access=admin,
                 doc=Doc(summary="Load a LoRA adapter (admin)",
                         body=schema.LoadLoraAdapterRequest))
        out.post("/v1/unload_lora_adapter", unload_lora_adapter(ctx), listeners=both,
                 access=admin, doc=Doc(summary="Unload a LoRA adapter (admin)",
                                       body=schema.UnloadLoraAdapterRequest))
    return out.routes


def _tokenize_body(data: object) -> bool:
    return has_key("prompt")(data) or has_key("messages")(data)


# ---- generation ------------------------------------------------------------------------------


class _Sse:
    """OpenAI's stream framing around a chunk encoder: in-band errors, then `[DONE]`."""

    def __init__(self, encoder: ChunkEncoder):
        # the encoder's own method, not a method calling it: one frame less per event
        self.encode: Callable[[GenerationEvent], bytes] = encoder.encode

    def error(self, exc: GatewayError) -> bytes:
        return errors.stream_error(exc)

    def end(self) -> bytes:
        return errors.DONE


def _sse(
    events: EventStream | BatchStream,
    encoder: ChunkEncoder,
) -> Answer:
    return EventStreamAnswer(events, _Sse(encoder), media_type=SSE_MEDIA_TYPE)


def chat_completions(ctx: ProtocolContext, *, sagemaker: bool = False) -> Endpoint:
    """`sagemaker`: on SAGEMAKER_PATHS, where DJL's adapter selectors name the model."""
    service = ctx.service

    async def create_chat_completion(request: Request) -> Answer:
        body = await _body(request, ctx, schema.ChatCompletionRequest, sagemaker=sagemaker)
        info = service.info()
        plan = tools.chat_plan(body, tool_call_parser=info.tool_call_parser)
        gen = requests.chat_request(
            body, request_id=_request_id(request, body), bounds=ctx.bounds, plan=plan,
            defaults=info.defaults, parse=info.reasoning_parser is not None,
        )
        view = chat_replies.ChatView.of(
            body, _meta(ctx, "chatcmpl", gen), tools=plan, parser=_parser(service, gen),
            parsed=gen.parse is not None,
        )
        if gen.stream:
            return _sse(await service.start(gen), chat_replies.ChatStreamEncoder(view))
        result = await until_disconnect(request, service.generate(gen))
        return json_response(chat_replies.chat_response(result, view))

    return create_chat_completion


def completions(ctx: ProtocolContext, *, sagemaker: bool = False) -> Endpoint:
    """`sagemaker`: on SAGEMAKER_PATHS, where DJL's adapter selectors name the model."""
    service = ctx.service

    async def create_completion(request: Request) -> Answer:
        body = await _body(request, ctx, schema.CompletionRequest, sagemaker=sagemaker)
        gens = requests.completion_requests(
            body, request_id=_request_id(request, body), bounds=ctx.bounds,
            defaults=service.defaults(),
        )
        prompts = [g.prompt for g in gens] if body.echo else []
        view = completion_replies.CompletionView.of(
            body, _meta(ctx, "cmpl", gens[0]), prompts=prompts,
            token_texts=service.token_texts,
        )
        if body.stream:
            events = await _start(service, gens)
            return _sse(events, completion_replies.CompletionStreamEncoder(view))
        result = await until_disconnect(request, _generate(service, gens))
        return json_response(completion_replies.completion_response(result, view))

    return create_completion


def _parser(
    service: InferenceService, gen: GenerationRequest
) -> Callable[[], OutputParser | None]:
    """A fresh output parser per choice, when the answer is parsed."""
    spec = gen.parse
    if spec is None:
        return lambda: None
    return lambda: service.output_parser(spec)


async def _start(
    service: InferenceService, gens: Sequence[GenerationRequest]
) -> EventStream | BatchStream:
    if len(gens) == 1:
        return await service.start(gens[0])
    return await service.start_batch(gens)


async def _generate(
    service: InferenceService, gens: Sequence[GenerationRequest]
) -> GenerationResult:
    if len(gens) == 1:
        return await service.generate(gens[0])
    return await service.generate_batch(gens)


# ---- the Responses API ---------------------------------------------------------------------------


def create_response(ctx: ProtocolContext, store: responses.ResponseStore) -> Endpoint:
    service = ctx.service

    async def create(request: Request) -> Answer:
        body = await _body(request, ctx, schema.ResponsesRequest)
        await store.pull(body.previous_response_id)
        info = service.info()
        facts = responses.ServerFacts(
            base_names=service.base_names, served_name=service.served_name, bounds=ctx.bounds,
            defaults=info.defaults, tool_call_parser=info.tool_call_parser,
            reasoning_parser=info.reasoning_parser,
        )
        call = responses.responses_call(
            body, request_id=_request_id(request, body), facts=facts, store=store
        )
        gen, parser = call.request, _parser(service, call.request)

        def keep(response: dict[str, Any]) -> None:
            if body.store is not False:
                store.put(call.id, responses.stored(call, response))

        if gen.stream:
            events = await service.start(gen)
            fmt = responses.ResponseEvents(call, parser(), on_complete=keep)
            return EventStreamAnswer(events, fmt, media_type=SSE_MEDIA_TYPE)
        result = await until_disconnect(request, service.generate(gen))
        reader = ChoiceReader(call.plan, parser())
        response = responses.final_response(call, result, reader)
        keep(response)
        return json_response(response)

    return create


def retrieve_response(store: responses.ResponseStore) -> Endpoint:
    async def retrieve(request: Request) -> Answer:
        response_id = request.path_params["response_id"]
        await store.pull(response_id)
        return json_response(store.get(response_id).response)

    return retrieve


def cancel_response(store: responses.ResponseStore) -> Endpoint:
    """Only background responses can be cancelled; none are served here (vLLM's answer for a
    stored synchronous one)."""

    async def cancel(request: Request) -> Answer:
        await request.body()  # an oversized body is refused (413) before any lookup
        response_id = request.path_params["response_id"]
        await store.pull(response_id)
        store.get(response_id)
        raise errors.CannotCancel("Cannot cancel a synchronous response.", param="response_id")

    return cancel


# ---- models ------------------------------------------------------------------------------------


def list_models(ctx: ProtocolContext) -> Endpoint:
    service = ctx.service

    async def show_available_models(request: Request) -> Answer:
        info = service.info()
        roots = None
        if request.scope.get(ADMIN_KEY, True):  # no auth configured: everyone is admin
            roots = {r.name: r.src for r in service.adapters.records()}
            roots.update(dict.fromkeys(_base_names(service), info.model_path))
        return json_response(
            models.model_list(
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

    async def show_model(request: Request) -> Answer:
        name = request.path_params["model"]
        await service.find_model(name)
        parent = None if name in service.base_names else service.served_name
        return json_response(models.model_object(name, created=ctx.created, parent=parent))

    return show_model


# ---- runtime LoRA --------------------------------------------------------------------------


def load_lora_adapter(ctx: ProtocolContext) -> Endpoint:
    adapters = ctx.service.adapters

    async def load(request: Request) -> Answer:
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
    if isinstance(exc, AdapterSourceMissing):
        return errors.LoraPathNotFound(f"Loading lora {name} failed: No adapter found for {path}")
    if type(exc) is InvalidRequest:
        return errors.InvalidUserInput(exc.message)
    return exc


def unload_lora_adapter(ctx: ProtocolContext) -> Endpoint:
    adapters = ctx.service.adapters

    async def unload(request: Request) -> Answer:
        name = (await _body(request, ctx, schema.UnloadLoraAdapterRequest)).lora_name
        if not name:
            raise errors.InvalidUserInput(
                "'lora_name' needs to be provided to unload a LoRA adapter."
            )
        try:
            if MERGED_NAME.fullmatch(name):  # composed by requests: not the manager's to remove
                raise AdapterNotFound(name)
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

    async def tokenize_text(request: Request) -> Answer:
        data = await read_json(request, ctx.max_body_bytes, strict_content_type=True)
        body: schema.TokenizeChatRequest | schema.TokenizeCompletionRequest
        text: str | ChatPrompt
        if isinstance(data, dict) and "messages" in data:
            body = _parse(schema.TokenizeChatRequest, data)
            text = requests.chat_prompt(body)
        else:
            body = _parse(schema.TokenizeCompletionRequest, data)
            text = body.prompt
        await service.find_model(body.model)
        ids = await service.tokenize(text, add_special_tokens=body.add_special_tokens)
        strs = service.token_texts(ids) if body.return_token_strs else None
        max_len = service.info().max_model_len
        return json_response(
            tokenizer.tokenize_response(ids, max_model_len=max_len, token_strs=strs)
        )

    return tokenize_text


def detokenize(ctx: ProtocolContext) -> Endpoint:
    service = ctx.service

    async def detokenize_ids(request: Request) -> Answer:
        body = await _body(request, ctx, schema.DetokenizeRequest)
        await service.find_model(body.model)
        vocab = service.info().vocab_size
        if any(token >= vocab for token in body.tokens):
            raise InvalidRequest(
                f"Token ids must be below the vocabulary size {vocab}.", param="tokens"
            )
        return json_response({"prompt": "".join(service.token_texts(body.tokens))})

    return detokenize_ids


def version(ctx: ProtocolContext) -> Endpoint:
    async def show_version(request: Request) -> Answer:
        return JSONResponse({"version": ctx.service.info().version})

    return show_version


# ---- helpers ------------------------------------------------------------------------------------


async def _body(
    request: Request, ctx: ProtocolContext, model: type[ModelT], *, sagemaker: bool = False
) -> ModelT:
    """The wire model; with `sagemaker`, its `model` is what DJL's selectors name, if any (one
    request: `adapters` is one name, or a list of one; vLLM copies the Identifier header the
    same way)."""
    chosen = sagemaker_selectors(request, ctx.service) if sagemaker else None
    data = await read_json(request, ctx.max_body_bytes, strict_content_type=True)
    body = _parse(model, data)
    names = None if chosen is None else chosen.names(1, data.get("adapters"))
    return body if names is None else body.model_copy(update={"model": names[0]})


def _parse(model: type[ModelT], data: Any) -> ModelT:
    """Validation errors as FastAPI reports them in vLLM: every pydantic error listed, the
    field named `body.<path>`, type "Bad Request"."""
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid_fields(exc) from None


MAX_LISTED_ERRORS = 10


def _invalid_fields(exc: ValidationError) -> errors.InvalidFields:
    found = exc.errors(include_url=False)
    count = len(found)
    lines = [f"  {_vllm_error(error)}"[:1000] for error in found[:MAX_LISTED_ERRORS]]
    if count > MAX_LISTED_ERRORS:
        lines.append(f"  ...and {count - MAX_LISTED_ERRORS} more errors")
    noun = "error" if count == 1 else "errors"
    message = f"{count} validation {noun}:\n" + "\n".join(lines)
    first = ".".join(str(p) for p in found[0]["loc"]) if found else ""
    param = _clean_param(first)
    return errors.InvalidFields(message.rstrip(), param=param and f"body.{param}")


def _vllm_error(error: Any) -> dict[str, Any]:
    """One pydantic error as vLLM prints it: loc joined with dots, the input summarised."""
    shown: dict[str, Any] = {
        "type": error["type"],
        "loc": ".".join(["body", *(str(p) for p in error["loc"])]),
        "msg": error["msg"],
        "input": _summary(error.get("input")),
    }
    if error.get("ctx"):
        shown["ctx"] = {key: _summary(value) for key, value in error["ctx"].items()}
    return shown


def _summary(value: object) -> str:
    if isinstance(value, dict | list | tuple | set):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _clean_param(param: str | None) -> str | None:
    """Drop pydantic's union-branch markers (`list[int]`, `str`, …) from an error path."""
    if not param:
        return None
    markers = {"str", "int", "float", "bool", "list", "dict", "none"}
    parts = [p for p in param.split(".") if p not in markers and not any(c in p for c in "[](){}")]
    return ".".join(parts) or None


def _request_id(
    request: Request, body: schema.SamplingFields | schema.ResponsesRequest
) -> str:
    return request_id_header(request) or body.request_id or current_request_id()


def _meta(ctx: ProtocolContext, prefix: str, gen: GenerationRequest) -> replies.ReplyMeta:
    service = ctx.service
    model = response_model(gen.model, service.base_names, service.served_name)
    # TGI's own client (text_generation.Client.chat) names the model "tgi" and requires TGI's
    # fingerprint, "<version>-<docker label or native>" (router/src/server.rs), on every chunk
    tgi = gen.model == TGI_CLIENT_MODEL
    fingerprint = f"{ctx.server_version}-native" if tgi else service.info().fingerprint
    return replies.ReplyMeta(
        id=f"{prefix}-{gen.request_id}", created=int(time.time()), model=model,
        fingerprint=fingerprint, fingerprint_each_chunk=tgi,
    )


TGI_CLIENT_MODEL = "tgi"


def _base_names(service: InferenceService) -> list[str]:
    """The served names (configured aliases select the base model but are not listed)."""
    others = service.base_names - service.aliases - {service.served_name}
    return [service.served_name, *sorted(others)]
