"""DJL / SageMaker adapter selectors (protocols/common/sagemaker.py): DJL's precedence, its errors,
and every selector on every body shape of `/invocations` and `/predictions/{m}`, in process on the
fake engine, whose first token names the adapter that ran ("[a1]")."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from protocols.common.sagemaker import COUNT_MISMATCH, Selectors, custom_attribute_adapter
from server.core.errors import InvalidRequest
from server.gateway import Gateway, register_startup_adapters
from tests.unit.demo_kit import unit_demo
from tests.unit.gateway_kit import client, make_gateway

DEMO = unit_demo()
IDENTIFIER = "X-Amzn-SageMaker-Adapter-Identifier"
ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
ADAPTER_MARK = re.compile(r"\[a\d\]")


# ---- precedence and errors (pure) ---------------------------------------------------------------

@pytest.mark.parametrize(
    ("selectors", "adapters", "expected"),
    [(Selectors(), None, None),
     (Selectors(), ["a1", ""], ["a1", ""]),
     (Selectors(), "a1", ["a1", "a1"]),
     (Selectors(workflow="wf"), ["a1", ""], ["wf", "wf"]),
     (Selectors(workflow="wf", query="q"), "a1", ["q", "q"]),
     (Selectors(workflow="wf", query="q", custom_attributes="c"), "a1", ["c", "c"]),
     (Selectors(workflow="wf", query="q", custom_attributes="c", header="h"), "a1", ["h", "h"]),
     (Selectors(query="q", header="h"), None, ["h", "h"]),
     (Selectors(header=""), ["a1", "a2"], ["", ""])],
    ids=["nothing", "body list", "body name", "workflow over body", "query over workflow",
         "attributes over query", "header over all", "header over query", "empty header = base"],
)
def test_later_selectors_win_as_djl_reads_them(
    selectors: Selectors, adapters: object, expected: list[str] | None
) -> None:
    assert selectors.names(2, adapters) == expected


def test_a_list_needs_one_adapter_per_input() -> None:
    with pytest.raises(InvalidRequest, match=COUNT_MISMATCH):
        Selectors().names(2, ["a1"])
    with pytest.raises(InvalidRequest, match=COUNT_MISMATCH):
        Selectors().names(1, ["a1", "a2"])


@pytest.mark.parametrize("adapters", [5, ["a1", 5], {"a": "b"}])
def test_adapters_of_another_type_are_refused(adapters: object) -> None:
    with pytest.raises(InvalidRequest, match="adapters must be a string or a list of strings"):
        Selectors(query="q").names(1, adapters)


@pytest.mark.parametrize(
    ("header", "expected"),
    [("adapter=a1", "a1"), ("x=1;adapter=a2", "a2"), (" Adapter = a3 ; x=1", "a3"),
     ("adapter=a1;adapter=a2", "a2"), ("adapter=a=b", "a=b"), ("x=1, adapter=a3", None),
     ("x=1", None), ("", None), (None, None)],
)
def test_custom_attributes_split_as_djls_request_parser(
    header: str | None, expected: str | None
) -> None:
    assert custom_attribute_adapter(header) == expected


# ---- every selector on every body shape (fake engine, in process) -------------------------------

SHAPES: dict[str, dict[str, Any]] = {
    "lmi": {"inputs": "a b", "parameters": {"max_new_tokens": 3}},
    "tgi": {"inputs": "a b", "parameters": {"max_new_tokens": 3}},  # with tgiCompat
    "chat": {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 3},
    "completion": {"prompt": "a b", "max_tokens": 3},
}


def _workflow(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "workflow.json"
    path.write_text(json.dumps({
        "name": "wf", "version": "0.1", "models": {"m": str(DEMO / "model")},
        "configs": {"adapters": {"a2": {"model": "m", "src": str(DEMO / "adapters" / "a2")}}},
        "workflow": {"out": ["adapter", "a2", "in"]},
    }))
    return str(path)


async def _gateway(tmp: Path, *, tgi_compat: bool) -> Gateway:
    gateway = make_gateway(overrides={
        "LoraConfig": {"adapterDir": str(DEMO / "adapters"), "adapterRoots": [str(DEMO)],
                       "workflows": [_workflow(tmp / "wf")]},
        "ProtocolConfig": {"tgiCompat": tgi_compat},
    })
    await register_startup_adapters(gateway)
    return gateway


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def djl(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    gateway = await _gateway(tmp_path_factory.mktemp("djl"), tgi_compat=False)
    async with client(gateway, "data") as http:
        yield http


@pytest.fixture(scope="module")
async def tgi(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    gateway = await _gateway(tmp_path_factory.mktemp("tgi"), tgi_compat=True)
    async with client(gateway, "data") as http:
        yield http


def _http(shape: str, djl: httpx.AsyncClient, tgi: httpx.AsyncClient) -> httpx.AsyncClient:
    return tgi if shape == "tgi" else djl


async def _post(
    http: httpx.AsyncClient, shape: str, path: str = "/invocations", *, stream: bool = False,
    params: dict[str, str] | None = None, headers: dict[str, str] | None = None, **extra: Any,
) -> httpx.Response:
    body = {**SHAPES[shape], **extra, **({"stream": True} if stream else {})}
    return await http.post(path, json=body, params=params, headers=headers)


def ran(response: httpx.Response) -> str:
    """The adapter the fake engine ran ("" = base), read from the answer on the wire."""
    assert response.status_code == 200, response.text
    marks = set(ADAPTER_MARK.findall(response.text))
    assert len(marks) <= 1, response.text
    return marks.pop()[1:-1] if marks else ""


def ways(name: str) -> dict[str, dict[str, Any]]:
    """Each selector naming `name`, as `_post` keyword arguments."""
    return {
        "body adapters": {"adapters": name},
        "query": {"params": {"adapter": name}},
        "custom attributes": {"headers": {ATTRIBUTES: f"x=1;adapter={name}"}},
        "identifier header": {"headers": {IDENTIFIER: name}},
    }


WAYS = list(ways("a1"))
# TGI's body never carries `adapters` (such a body is DJL's) and is TGI's on /invocations only.
CASES = [(shape, way, path, stream)
         for shape in SHAPES for way in WAYS for path in ("/invocations", "/predictions/tiny")
         for stream in (False, True)
         if not (shape == "tgi" and (way == "body adapters" or path != "/invocations"))]


@pytest.mark.anyio
@pytest.mark.parametrize(("shape", "way", "path", "stream"), CASES)
async def test_every_selector_runs_its_adapter_on_every_body_shape(
    djl: httpx.AsyncClient, tgi: httpx.AsyncClient, shape: str, way: str, path: str, stream: bool
) -> None:
    http = _http(shape, djl, tgi)
    assert ran(await _post(http, shape, path, stream=stream)) == ""
    assert ran(await _post(http, shape, path, stream=stream, **ways("a1")[way])) == "a1"


@pytest.mark.anyio
@pytest.mark.parametrize("shape", list(SHAPES))
async def test_a_workflow_named_by_path_or_model_name_runs_its_adapter(
    djl: httpx.AsyncClient, tgi: httpx.AsyncClient, shape: str
) -> None:
    http = _http(shape, djl, tgi)
    assert ran(await _post(http, shape, params={"model_name": "wf"})) == "a2"
    if shape != "tgi":  # /predictions/{m} stays DJL's with tgiCompat
        assert ran(await _post(http, shape, "/predictions/wf")) == "a2"
        assert ran(await _post(http, shape, "/predictions/wf", params={"adapter": "a1"})) == "a1"


@pytest.mark.anyio
@pytest.mark.parametrize("shape", list(SHAPES))
async def test_the_later_selector_wins_on_every_body_shape(
    djl: httpx.AsyncClient, tgi: httpx.AsyncClient, shape: str
) -> None:
    http = _http(shape, djl, tgi)
    owns: dict[str, dict[str, Any]] = {  # the body's own selector, the lowest
        "tgi": {"parameters": {"max_new_tokens": 3, "adapter_id": "a3"}},
        "chat": {"model": "a3"}, "completion": {"model": "a3"}}
    own = owns.get(shape, {})
    assert ran(await _post(http, shape, **own)) == ("a3" if own else "")
    body: dict[str, Any] = {} if shape == "tgi" else {"adapters": "a2"}
    assert ran(await _post(http, shape, **own, **body)) == ("a3" if shape == "tgi" else "a2")
    query = {"adapter": "a1"}
    assert ran(await _post(http, shape, params=query, **own, **body)) == "a1"
    headers = {ATTRIBUTES: "adapter=a2"}
    assert ran(await _post(http, shape, params=query, headers=headers, **own, **body)) == "a2"
    headers[IDENTIFIER] = "a3"
    assert ran(await _post(http, shape, params=query, headers=headers, **own, **body)) == "a3"
    headers[IDENTIFIER] = ""  # the header names the base model
    assert ran(await _post(http, shape, params=query, headers=headers, **own, **body)) == ""


# Each body shape answers in the shape of the protocol that serves it: DJL's handler (424, as
# djl_python and ModelInfo.java answer), OpenAI's (vLLM's SageMaker route), TGI's (422).
UNKNOWN = {
    "lmi": (424, {"error": "Adapter zz is not registered", "code": 424}),
    "tgi": (422, {"error": "Input validation error: adapter_id `zz` is not a loaded adapter "
                           "(loaded: a1, a2, a3)", "error_type": "validation"}),
    "chat": (404, {"error": {"message": "The model `zz` does not exist. Valid aliases: tiny.",
                             "type": "NotFoundError", "param": "model", "code": 404}}),
    "completion": (404, {"error": {"message": "The model `zz` does not exist. Valid aliases: "
                                   "tiny.", "type": "NotFoundError", "param": "model",
                                   "code": 404}}),
}


@pytest.mark.anyio
@pytest.mark.parametrize(("shape", "way"), sorted({(shape, way) for shape, way, _, _ in CASES}))
async def test_an_unknown_adapter_is_the_serving_protocols_error_never_the_base(
    djl: httpx.AsyncClient, tgi: httpx.AsyncClient, shape: str, way: str
) -> None:
    response = await _post(_http(shape, djl, tgi), shape, **ways("zz")[way])
    assert (response.status_code, response.json()) == UNKNOWN[shape]


@pytest.mark.anyio
@pytest.mark.parametrize("shape", list(SHAPES))
async def test_an_empty_adapter_query_is_refused(
    djl: httpx.AsyncClient, tgi: httpx.AsyncClient, shape: str
) -> None:
    response = await _post(_http(shape, djl, tgi), shape, params={"adapter": ""})
    assert response.status_code == UNKNOWN[shape][0]
    assert "The adapter named by ?adapter= is empty" in response.text


@pytest.mark.anyio
async def test_a_list_of_adapters_that_cannot_apply_is_an_error(djl: httpx.AsyncClient) -> None:
    lmi = await _post(djl, "lmi", inputs=["a", "b"], adapters=["a1"])
    assert (lmi.status_code, lmi.json()) == (424, {"error": COUNT_MISMATCH, "code": 424})
    for shape in ("chat", "completion"):  # one request, one adapter
        response = await _post(djl, shape, adapters=["a1", "a2"])
        assert response.status_code == 400
        assert response.json()["error"]["message"] == COUNT_MISMATCH
        assert ran(await _post(djl, shape, adapters=["a1"])) == "a1"
    prompts = await _post(djl, "completion", prompt=["a", "b"], adapters="a1")
    assert prompts.json()["model"] == "a1" and len(prompts.json()["choices"]) == 2
    typed = await _post(djl, "chat", adapters=5)
    assert typed.status_code == 400 and "adapters must be a string" in typed.text


@pytest.mark.anyio
async def test_an_unknown_workflow_is_404_in_each_shape(
    djl: httpx.AsyncClient, tgi: httpx.AsyncClient
) -> None:
    lmi = await _post(djl, "lmi", "/predictions/nope")
    assert (lmi.status_code, lmi.json()) == (404, {
        "code": 404, "type": "ModelNotFoundException",
        "message": "Model or workflow not found: nope"})
    chat = await _post(djl, "chat", "/predictions/nope")
    assert chat.status_code == 404 and chat.json()["error"]["type"] == "NotFoundError"
    compat = await _post(tgi, "tgi", params={"model_name": "nope"})
    assert compat.status_code == 422 and "nope" in compat.json()["error"]


@pytest.mark.anyio
async def test_other_protocols_keep_their_own_selectors(djl: httpx.AsyncClient) -> None:
    chat = {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 3}
    assert ran(await djl.post("/v1/chat/completions", json={**chat, "model": "a1"})) == "a1"
    # DJL's selectors are SageMaker's: OpenAI's own route reads only `model`, as vLLM does
    plain = await djl.post("/v1/chat/completions", json=chat, params={"adapter": "a1"},
                           headers={IDENTIFIER: "a1"})
    assert ran(plain) == ""
    tgi = {"inputs": "a b", "parameters": {"max_new_tokens": 3, "adapter_id": "a2"}}
    assert ran(await djl.post("/generate", json=tgi)) == "a2"
    triton = {"text_input": "a b", "max_tokens": 3}
    assert ran(await djl.post("/v2/models/a3/generate", json=triton)) == "a3"
