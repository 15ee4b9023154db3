"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and
`POST /v1/messages/count_tokens`.

Each endpoint parses, translates, calls the service and encodes; errors render in Anthropic's
envelope before the first byte and as an `error` event after it. Every answer carries Anthropic's
`request-id` header. `anthropic-version` and `anthropic-beta` are accepted whatever their value;
keys come as `x-api-key` or `Authorization: Bearer` (the listener app reads both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from protocols.anthropic import errors, schema, translate
from protocols.common.chat import response_model
from protocols.common.tools import ChoiceReader
from server.core.engine import OutputParser
from server.core.errors import GatewayError, InvalidRequest
from server.core.service import InferenceService
from server.core.types import GenerationEvent, GenerationRequest
from server.http.body import json_response, read_json
from server.http.context import ProtocolContext, current_request_id
from server.http.disconnect import until_disconnect
from server.http.routes import Answer, Doc, Endpoint, Route, RouteList
from server.http.streaming import EventStreamAnswer

ModelT = TypeVar("ModelT", bound=BaseModel)
NAME = "anthropic"
SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"
MAX_LISTED_ERRORS = 10


def routes(ctx: ProtocolContext) -> list[Route]:
    out = RouteList(owner=NAME, render=errors.render)
    out.post("/v1/messages", create_message(ctx),
             doc=Doc(summary="Anthropic Messages API", body=schema.MessagesRequest, streams=True))
    out.post("/v1/messages/count_tokens", count_tokens(ctx),
             doc=Doc(summary="Anthropic token count", body=schema.CountTokensRequest))
    return out.routes


class _Events:
    """Anthropic's stream framing around the encoder: the `error` event, no terminator."""

    def __init__(self, encoder: translate.MessageStreamEncoder) -> None:
        # the encoder's own method, not a method calling it: one frame less per event
        self.encode: Callable[[GenerationEvent], bytes] = encoder.encode

    def error(self, exc: GatewayError) -> bytes:
        return errors.stream_error(exc)

    def end(self) -> bytes:
        return b""


def create_message(ctx: ProtocolContext) -> Endpoint:
    service = ctx.service

    async def create(request: Request) -> Answer:
        body = await _body(request, ctx, schema.MessagesRequest)
        info = service.info()
        plan = translate.tool_plan(body, tool_call_parser=info.tool_call_parser)
        request_id = current_request_id()
        gen = translate.message_request(
            body, request_id=request_id, plan=plan, bounds=ctx.bounds, defaults=info.defaults,
            reasoning_parser=info.reasoning_parser,
        )
        view = translate.ReplyView(
            id=f"msg_{request_id}",
            model=response_model(gen.model, service.base_names, service.served_name),
            plan=plan,
            stop_sequences=gen.sampling.stop,
        )
        reader = ChoiceReader(plan, _parser(service, gen))
        headers = {"request-id": request_id}
        if gen.stream:
            encoder = translate.MessageStreamEncoder(view, reader)
            return EventStreamAnswer(
                await service.start(gen), _Events(encoder), media_type=SSE_MEDIA_TYPE,
                headers=headers,
            )
        result = await until_disconnect(request, service.generate(gen))
        return json_response(translate.message_response(result, view, reader), headers=headers)

    return create


def count_tokens(ctx: ProtocolContext) -> Endpoint:
    """The prompt's tokens exactly as a generation counts them (`usage.input_tokens`)."""
    service = ctx.service

    async def count(request: Request) -> Answer:
        body = await _body(request, ctx, schema.CountTokensRequest)
        await service.find_model(body.model)
        plan = translate.tool_plan(body, tool_call_parser=service.info().tool_call_parser)
        translate.output_format(body)  # both formats given is a 400 here too
        prompt = translate.chat_prompt(body, plan)
        ids = await service.tokenize(prompt, add_special_tokens=False)
        return json_response(
            translate.count_tokens_response(len(ids)),
            headers={"request-id": current_request_id()},
        )

    return count


def _parser(service: InferenceService, gen: GenerationRequest) -> OutputParser | None:
    return service.output_parser(gen.parse) if gen.parse is not None else None


# ---- bodies ------------------------------------------------------------------------------------


async def _body(request: Request, ctx: ProtocolContext, model: type[ModelT]) -> ModelT:
    data = await read_json(request, ctx.max_body_bytes)
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> InvalidRequest:
    """Validation errors as Anthropic words them: `<field path>: <problem>`, one per line."""
    found = exc.errors(include_url=False, include_input=False)
    lines = [f"{_path(error['loc'])}: {error['msg']}" for error in found[:MAX_LISTED_ERRORS]]
    if len(found) > MAX_LISTED_ERRORS:
        lines.append(f"...and {len(found) - MAX_LISTED_ERRORS} more errors")
    first = _path(found[0]["loc"]) if found else None
    return InvalidRequest("\n".join(lines), param=first)


def _path(loc: tuple[int | str, ...]) -> str:
    """A field's path without pydantic's union-branch markers (`str`, `list[...]`)."""
    parts = [str(p) for p in loc]
    kept = [p for p in parts if p not in _MARKERS and not any(c in p for c in "[](){}")]
    return ".".join(kept) or "body"


_MARKERS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
