"""The OpenAPI 3.1 description of every route, per listener, built from the protocols' pydantic
wire models and one route table (`OPERATIONS`). Served as `GET /openapi.json` on the management
listener (`?listener=data|management|metrics`, default data); fuzzed by schemathesis in
tests/integration/test_fuzz_schemathesis.py; tests/unit/test_openapi.py checks that the table
and the listeners' routes agree.

Bodies whose top-level keys are dynamic (Triton's generate extension, MindIE's role topology)
have a hand-written schema here; everything else is the wire model the route validates with.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from protocols._common.http import json_response
from protocols.djl import schema as djl
from protocols.kserve_v2 import schema as kserve
from protocols.mindie import schema as mindie
from protocols.openai_v1 import schema as openai
from protocols.tgi import schema as tgi
from server import __version__
from server.settings import Settings

JSON = dict[str, Any]
Body = type[BaseModel] | JSON | tuple[type[BaseModel], ...] | None
# A hand-written body may name wire models it embeds; they are added to the components.
EMBEDS = "x-embeds"
LISTENERS = ("data", "management", "metrics")
VERSIONED = "/versions/{version}"

KSERVE_GENERATE: JSON = {
    "type": "object",
    "description": "Triton generate extension: inputs by name at the top level; other keys "
    "are request parameters (scalars or lists of scalars).",
    "properties": {
        "id": {"type": "string", "maxLength": 256},
        "text_input": {"type": "string"},
        "stream": {"type": "boolean"},
        "sampling_parameters": {"type": "string"},
        "exclude_input_in_output": {"type": "boolean"},
        "return_finish_reason": {"type": "boolean"},
        "return_cumulative_logprob": {"type": "boolean"},
        "return_logprobs": {"type": "boolean"},
        "return_num_input_tokens": {"type": "boolean"},
        "return_num_output_tokens": {"type": "boolean"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0},
        "parameters": {"type": "object"},
    },
    "required": ["text_input"],
}
MINDIE_INFER: JSON = {
    EMBEDS: [mindie.InferParameters],
    "type": "object",
    "properties": {
        "inputs": {"type": "string"},
        "stream": {"type": "boolean"},
        "parameters": {"$ref": "#/components/schemas/mindie.InferParameters"},
    },
    "required": ["inputs"],
}
MINDIE_INFER_TOKEN: JSON = {
    EMBEDS: [mindie.InferParameters],
    "type": "object",
    "properties": {
        "input_id": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "stream": {"type": "boolean"},
        "parameters": {"$ref": "#/components/schemas/mindie.InferParameters"},
    },
    "required": ["input_id"],
}
MINDIE_TOKENIZER: JSON = {
    "type": "object",
    "properties": {"inputs": {"type": "string"}, "do_decode": {"type": "boolean"}},
    "required": ["inputs"],
}
ROLE_TOPOLOGY: JSON = {
    "type": "object",
    "properties": {"local": {}, "peers": {"type": "array"}},
}


@dataclass(frozen=True, slots=True)
class Operation:
    listener: str
    method: str
    path: str
    tag: str
    summary: str
    body: Body = None
    query: tuple[str, ...] = ()
    streams: bool = False  # may answer with a stream (SSE or JSON lines)
    extra: JSON = field(default_factory=dict)


def _op(listener: str, method: str, path: str, tag: str, summary: str, **kw: Any) -> Operation:
    return Operation(listener, method, path, tag, summary, **kw)


def _openai() -> list[Operation]:
    d = "data"
    return [
        _op(d, "POST", "/v1/chat/completions", "openai", "Chat completion",
            body=openai.ChatCompletionRequest, streams=True),
        _op(d, "POST", "/v1/completions", "openai", "Completion",
            body=openai.CompletionRequest, streams=True),
        _op(d, "GET", "/v1/models", "openai", "Served models and adapters"),
        _op(d, "GET", "/v1/models/{model}", "openai", "One model"),
        _op(d, "POST", "/detokenize", "openai", "Token ids to text", body=openai.DetokenizeRequest),
        _op(d, "GET", "/version", "openai", "Server version"),
        *_lora_routes(d),
        *_djl_adapters(d),  # adapter management is on the data listener too (admin keys)
    ]


def _lora_routes(listener: str) -> list[Operation]:
    return [
        _op(listener, "POST", "/v1/load_lora_adapter", "openai", "Load a LoRA adapter (admin)",
            body=openai.LoadLoraAdapterRequest),
        _op(listener, "POST", "/v1/unload_lora_adapter", "openai",
            "Unload a LoRA adapter (admin)", body=openai.UnloadLoraAdapterRequest),
    ]


def _shared() -> list[Operation]:
    d = "data"
    return [
        _op(d, "POST", "/generate", "shared", "TGI generate, or MindIE's vLLM flavour with "
            "`prompt`", body=(tgi.GenerateRequest, mindie.VllmGenerateRequest), streams=True),
        _op(d, "POST", "/invocations", "shared", "SageMaker: chat (`messages`), completion "
            "(`prompt`) or LMI (`inputs`)",
            body=(openai.ChatCompletionRequest, openai.CompletionRequest, djl.LmiRequest),
            streams=True),
        _op(d, "POST", "/tokenize", "shared", "vLLM tokenize (`prompt`/`messages`) or TGI",
            body=(openai.TokenizeCompletionRequest, openai.TokenizeChatRequest,
                  tgi.GenerateRequest)),
    ]


def _tgi() -> list[Operation]:
    d = "data"
    return [
        _op(d, "GET", "/health", "tgi", "Health (open)"),
        _op(d, "GET", "/", "tgi", "Health alias (open)"),
        _op(d, "POST", "/", "tgi", "Generate, streamed when `stream` is true",
            body=tgi.GenerateRequest, streams=True),
        _op(d, "POST", "/generate_stream", "tgi", "Generate as SSE", body=tgi.GenerateRequest,
            streams=True),
        _op(d, "GET", "/info", "tgi", "Model and router info"),
    ]


def _kserve() -> list[Operation]:
    d = "data"
    ops = [
        _op(d, "GET", "/v2", "kserve", "Server metadata"),
        _op(d, "GET", "/v2/health/live", "kserve", "Liveness (open)"),
        _op(d, "GET", "/v2/health/ready", "kserve", "Readiness (open)"),
        _op(d, "GET", "/v2/models/stats", "kserve", "Statistics of every model"),
    ]
    per_model: list[tuple[str, str, str, Body, bool]] = [
        ("GET", "", "Model metadata", None, False),
        ("GET", "/ready", "Model readiness (open)", None, False),
        ("GET", "/config", "Model configuration", None, False),
        ("GET", "/stats", "Model statistics", None, False),
        ("POST", "/infer", "Inference (JSON tensors)", kserve.InferRequest, False),
        ("POST", "/generate", "Generate extension", KSERVE_GENERATE, False),
        ("POST", "/generate_stream", "Generate extension, SSE", KSERVE_GENERATE, True),
        ("POST", "/stopInfer", "Stop a running request by id (MindIE)", kserve.StopInferRequest,
         False),
        ("GET", "/getSlotCount", "Free engine slots (MindIE)", None, False),
    ]
    for method, suffix, summary, body, streams in per_model:
        for prefix in ("/v2/models/{model}", "/v2/models/{model}" + VERSIONED):
            ops.append(_op(d, method, prefix + suffix, "kserve", summary, body=body,
                           streams=streams))
    return ops


def _mindie() -> list[Operation]:
    d = "data"
    return [
        _op(d, "POST", "/infer", "mindie", "Inference on text", body=MINDIE_INFER, streams=True),
        _op(d, "POST", "/infer_token", "mindie", "Inference on token ids",
            body=MINDIE_INFER_TOKEN, streams=True),
        _op(d, "POST", "/v1/tokenizer", "mindie", "Tokenize", body=MINDIE_TOKENIZER),
    ]


def _djl() -> list[Operation]:
    d = "data"
    ops = [
        _op(d, "GET", "/ping", "djl", "Health (open)"),
        _op(d, "POST", "/ping", "djl", "Health (open)"),
    ]
    for path in ("/predictions/{model}", "/predictions/{model}/{version}"):
        ops.append(_op(d, "POST", path, "djl", "LMI inference", body=djl.LmiRequest,
                       query=("adapter",), streams=True))
    return ops


def _djl_adapters(m: str) -> list[Operation]:
    form = ("name", "src", "preload", "pin")
    ops: list[Operation] = []
    for prefix in ("/models/{model}", ""):
        ops += [
            _op(m, "GET", f"{prefix}/adapters", "djl", "List adapters",
                query=("limit", "next_page_token")),
            _op(m, "POST", f"{prefix}/adapters", "djl", "Register an adapter",
                body=djl.AdapterForm, query=form),
            _op(m, "GET", f"{prefix}/adapters/{{name}}", "djl", "Describe an adapter"),
            _op(m, "DELETE", f"{prefix}/adapters/{{name}}", "djl", "Unregister an adapter"),
            _op(m, "POST", f"{prefix}/adapters/{{name}}/update", "djl", "Update an adapter",
                body=djl.AdapterForm, query=("src", "preload", "pin")),
        ]
    return ops


def _control() -> list[Operation]:
    m = "management"
    return [
        _op(m, "GET", "/stopService", "control", "Graceful stop (`mode=Force` aborts)",
            query=("mode",)),
        _op(m, "GET", "/v1/status", "control", "Status"),
        _op(m, "GET", "/v2/status", "control", "Status (v2)"),
        _op(m, "GET", "/v1/config", "control", "Configuration, secrets redacted"),
        _op(m, "POST", "/v1/role/{role}", "control", "Switch role", body=ROLE_TOPOLOGY),
        _op(m, "POST", "/v2/role/{role}", "control", "Switch role (v2)", body=ROLE_TOPOLOGY),
        _op(m, "GET", "/health/timed", "control", "One-token probe (open)"),
        _op(m, "GET", "/health/timed-{seconds}", "control", "One-token probe (open)"),
        _op(m, "GET", "/openapi.json", "control", "This description",
            query=("listener",)),
        *_lora_routes(m),
        *_djl_adapters(m),
        *_metrics(m),
        _op(m, "GET", "/v2/health/live", "health", "Liveness (open)"),
        _op(m, "GET", "/v2/health/ready", "health", "Readiness (open)"),
        _op(m, "GET", "/health", "health", "Model health (open)"),
        _op(m, "GET", "/v2/models/{model}/ready", "health", "Model readiness (open)"),
        _op(m, "GET", "/v2/models/{model}" + VERSIONED + "/ready", "health",
            "Model readiness (open)"),
        _op(m, "GET", "/v2/models/{model}/getSlotCount", "health", "Free engine slots"),
        _op(m, "GET", "/v2/models/{model}" + VERSIONED + "/getSlotCount", "health",
            "Free engine slots"),
    ]


def _metrics(listener: str) -> list[Operation]:
    return [
        _op(listener, "GET", "/metrics", "metrics", "Prometheus text (vllm: and gateway_)"),
        _op(listener, "GET", "/metrics-json", "metrics", "MindIE JSON metrics"),
    ]


OPERATIONS: tuple[Operation, ...] = (
    *_shared(), *_openai(), *_tgi(), *_kserve(), *_mindie(), *_djl(), *_control(),
    *_metrics("metrics"),
)


# ---- document -------------------------------------------------------------------------------
class Components:
    """`components.schemas`, namespaced by protocol (kserve and mindie both have InferRequest)."""

    def __init__(self) -> None:
        self.schemas: dict[str, JSON] = {}

    def ref(self, tag: str, model: type[BaseModel]) -> JSON:
        name = f"{tag}.{model.__name__}"
        if name not in self.schemas:
            schema = model.model_json_schema(ref_template=f"#/components/schemas/{tag}.{{model}}")
            for sub, definition in schema.pop("$defs", {}).items():
                self.schemas.setdefault(f"{tag}.{sub}", definition)
            self.schemas[name] = schema
        return {"$ref": f"#/components/schemas/{name}"}


MODEL_TAGS = {
    openai: "openai", tgi: "tgi", kserve: "kserve", mindie: "mindie", djl: "djl",
}


def _model_tag(model: type[BaseModel]) -> str:
    module = model.__module__
    return next((tag for mod, tag in MODEL_TAGS.items() if mod.__name__ == module), "gateway")


def _body_schema(body: Body, components: Components) -> JSON:
    if isinstance(body, tuple):
        return {"anyOf": [components.ref(_model_tag(m), m) for m in body]}
    if isinstance(body, dict):
        for model in body.get(EMBEDS, ()):
            components.ref(_model_tag(model), model)
        return {k: v for k, v in body.items() if k != EMBEDS}
    assert body is not None
    return components.ref(_model_tag(body), body)


PATH_PARAM = re.compile(r"{(\w+)}")


def _operation(op: Operation, components: Components) -> JSON:
    params: list[JSON] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string",
                                                                  "minLength": 1}}
        for name in PATH_PARAM.findall(op.path)
    ]
    params += [
        {"name": name, "in": "query", "required": False, "schema": {"type": "string"}}
        for name in op.query
    ]
    media = ["application/json"] + (["text/event-stream"] if op.streams else [])
    entry: JSON = {
        "tags": [op.tag],
        "summary": op.summary,
        "operationId": f"{op.listener}:{op.method.lower()}:{op.path}",
        "parameters": params,
        "responses": {
            "200": {"description": "Success", "content": {m: {} for m in media}},
            "4XX": {"description": "A client error, in the protocol's own error envelope"},
        },
        **op.extra,
    }
    if op.body is not None:
        entry["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _body_schema(op.body, components)}},
        }
    return entry


def listener_url(settings: Settings, listener: str) -> str:
    """The base URL of `listener` ("data", "management", "metrics") as configured."""
    address = settings.server.listener(listener)
    scheme = "https" if address.tls.enabled else "http"
    return f"{scheme}://{address.host}:{address.port}"


def openapi_document(settings: Settings, listener: str = "data") -> JSON:
    """The OpenAPI 3.1 document of one listener's routes."""
    components = Components()
    paths: dict[str, JSON] = {}
    for op in OPERATIONS:
        if op.listener == listener:
            paths.setdefault(op.path, {})[op.method.lower()] = _operation(op, components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": f"llm-gateway {listener} listener",
            "version": __version__,
            "description": "OpenAI (vLLM), TGI, KServe v2/Triton, MindIE and DJL/SageMaker "
            "routes over one engine. With API keys configured, every route but the health "
            "family needs `Authorization: Bearer <key>`; control and adapter management "
            "routes need an admin key.",
        },
        "servers": [{"url": listener_url(settings, listener)}],
        "paths": paths,
        "components": {
            "schemas": components.schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def documented(listener: str) -> Iterable[tuple[str, str]]:
    """(method, path) of every documented operation of a listener."""
    return ((op.method, op.path) for op in OPERATIONS if op.listener == listener)


def openapi_routes(settings: Settings) -> Sequence[BaseRoute]:
    documents = {name: openapi_document(settings, name) for name in LISTENERS}

    async def endpoint(request: Request) -> Response:
        listener = request.query_params.get("listener", "data")
        if listener not in documents:
            return json_response(
                {"error": f"listener must be one of {', '.join(LISTENERS)}",
                 "error_type": "Bad Request"},
                400,
            )
        return json_response(documents[listener])

    return [Route("/openapi.json", endpoint, methods=["GET"])]
