"""The OpenAPI 3.1 description of every listener, built from the routes the listener serves
(their `Doc`: summary, wire models, query parameters, streaming), so the description cannot
drift from the routing. Served as `GET /openapi.json` on the management listener
(`?listener=data|management|metrics`, default data); fuzzed by schemathesis in
tests/integration/test_fuzz_schemathesis.py.

Routes sharing a path by body (`/generate`, `/invocations`, `/tokenize`) become one operation
tagged `shared` whose body is any of theirs. Routes without a `Doc` are not described.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request

from server import __version__
from server.core.errors import InvalidRequest
from server.http.body import json_response
from server.http.routes import (
    EMBEDS,
    MANAGEMENT,
    Access,
    Answer,
    Body,
    Doc,
    Render,
    Route,
    RouteList,
)

JSON = dict[str, Any]
PATH_PARAM = re.compile(r"{(\w+)(?::\w+)?}")
SHARED = "shared"
OWNER = "control"  # the route's metrics label and OpenAPI tag, as the control plane's


class Components:
    """`components.schemas`, namespaced by owner (kserve and mindie both have InferRequest)."""

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

    def body(self, tag: str, body: Body) -> list[JSON]:
        """The schemas of one route's body (several for a tuple of models)."""
        if isinstance(body, tuple):
            return [self.ref(tag, model) for model in body]
        if isinstance(body, dict):
            for model in body.get(EMBEDS, ()):
                self.ref(tag, model)
            return [{k: v for k, v in body.items() if k != EMBEDS}]
        assert body is not None
        return [self.ref(tag, body)]


def _operation(listener: str, group: Sequence[Route], components: Components) -> JSON:
    """One operation for the routes of one method and path (several on a shared path)."""
    first = group[0]
    docs = [route.doc for route in group if route.doc is not None]
    tag = first.owner if len(group) == 1 else SHARED
    params: list[JSON] = [
        {"name": name, "in": "path", "required": True,
         "schema": {"type": "string", "minLength": 1}}
        for name in PATH_PARAM.findall(first.path)
    ]
    queries = dict.fromkeys(q for doc in docs for q in doc.query)
    params += [
        {"name": name, "in": "query", "required": False, "schema": {"type": "string"}}
        for name in queries
    ]
    streams = any(doc.streams for doc in docs)
    media = ["application/json"] + (["text/event-stream"] if streams else [])
    entry: JSON = {
        "tags": [tag],
        "summary": "; ".join(doc.summary for doc in docs),
        "operationId": f"{listener}:{first.method.lower()}:{_plain(first.path)}",
        "parameters": params,
        "responses": {
            "200": {"description": "Success", "content": {m: {} for m in media}},
            "4XX": {"description": "A client error, in the protocol's own error envelope"},
        },
    }
    schemas = [s for route in group if route.doc and route.doc.body is not None
               for s in components.body(route.owner, route.doc.body)]
    if schemas:
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        entry["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": schema}},
        }
    return entry


def _plain(path: str) -> str:
    """The path as OpenAPI writes it: `{model:path}` → `{model}`."""
    return PATH_PARAM.sub(lambda m: "{" + m.group(1) + "}", path)


def openapi_document(listener: str, routes: Sequence[Route], server_url: str) -> JSON:
    """The OpenAPI 3.1 document of one listener's routes (as served: `routes` after overrides)."""
    groups: dict[tuple[str, str], list[Route]] = {}
    for route in routes:
        if route.doc is not None and route.method != "HEAD":
            groups.setdefault((_plain(route.path), route.method), []).append(route)
    components = Components()
    paths: dict[str, JSON] = {}
    for (path, method), group in groups.items():
        paths.setdefault(path, {})[method.lower()] = _operation(listener, group, components)
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
        "servers": [{"url": server_url}],
        "paths": paths,
        "components": {
            "schemas": components.schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def routes(documents: Callable[[str], JSON | None], render: Render) -> list[Route]:
    """`GET /openapi.json?listener=data|management|metrics` on the management listener (admin);
    `documents` gives a listener's document once every route is built."""

    async def endpoint(request: Request) -> Answer:
        listener = request.query_params.get("listener", "data")
        document = documents(listener)
        if document is None:
            return render(InvalidRequest("listener must be one of data, management, metrics"))
        return json_response(document)

    out = RouteList(
        owner=OWNER, render=render, listeners=frozenset({MANAGEMENT}), access=Access.ADMIN
    )
    out.get("/openapi.json", endpoint, doc=Doc(summary="This description", query=("listener",)))
    return out.routes
