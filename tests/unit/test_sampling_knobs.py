"""Every sampling knob applied or refused, never dropped (issue 19): OpenAI's `best_of`, which
vLLM 0.32 ignores, is bounded by `LimitsConfig.maxBestOf` and refused beyond `n`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from server.engines.fake import FakeEngine
from tests.unit.gateway_kit import client, make_gateway

pytestmark = pytest.mark.anyio

COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    gateway = make_gateway(overrides={"LimitsConfig": {"maxBestOf": 4}})
    async with client(gateway, "data") as http:
        yield http


@pytest.mark.parametrize("path,base", [("/v1/completions", COMPLETION),
                                       ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize(
    "fields,message",
    [
        ({"best_of": 1_000_000}, "best_of must be between 1 and 4, got 1000000."),
        ({"best_of": 0}, "best_of must be between 1 and 4, got 0."),
        ({"best_of": 1, "n": 2},
         "best_of must be greater than or equal to n, got n=2 and best_of=1."),
        ({"best_of": 3, "n": 2}, "best_of > n is not supported by this server"),
        ({"best_of": "x"}, "best_of"),
    ],
)
async def test_best_of_is_bounded_and_refused_beyond_n(
    http: httpx.AsyncClient, path: str, base: dict[str, Any], fields: dict[str, Any], message: str
) -> None:
    response = await http.post(path, json={**base, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert error["param"].endswith("best_of")  # validation errors: "body.best_of", as vLLM
    assert error["type"] in ("BadRequestError", "Bad Request")  # ours, and vLLM's 422 → 400


@pytest.mark.parametrize("fields,choices", [({"best_of": None}, 1), ({"best_of": 1}, 1),
                                            ({"best_of": 2, "n": 2}, 2)])
async def test_best_of_that_asks_for_nothing_beyond_n_is_served(
    http: httpx.AsyncClient, fields: dict[str, Any], choices: int
) -> None:
    response = await http.post("/v1/completions", json={**COMPLETION, **fields})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == choices


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {**COMPLETION, "watermarking": True}, "watermarking"),
        ("/v1/completions", {**COMPLETION, "truncation_side": "right"}, "truncation_side"),
        ("/v1/completions", {**COMPLETION, "vllm_xargs": {"a": 1}}, "vllm_xargs"),
        ("/v1/chat/completions", {**CHAT, "documents": [{"text": "x"}]}, "documents"),
        ("/v1/chat/completions", {**CHAT, "cache_salt": "tenant"}, "cache_salt"),
        ("/v1/responses", {"model": "tiny", "input": "hi", "enable_response_messages": True},
         "enable_response_messages"),
    ],
)
async def test_openai_fields_the_engine_cannot_honour_are_refused(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    response = await http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] == f"`{param}` is not supported by this server."
    assert error["param"] == param


@pytest.mark.parametrize("fields", [
    {"watermarking": False, "length_penalty": 1, "truncation_side": "left", "cache_salt": None,
     "session_id": "s", "return_token_offsets": False, "mm_payload": "tensors"},
])
async def test_openai_fields_at_vllms_default_are_served(
    http: httpx.AsyncClient, fields: dict[str, Any]
) -> None:
    response = await http.post("/v1/completions", json={**COMPLETION, **fields})
    assert response.status_code == 200, response.text


LMI = {"inputs": "hi", "parameters": {"max_new_tokens": 3}}


@pytest.mark.parametrize("name,value", [("num_beams", 2), ("use_beam_search", True),
                                        ("length_penalty", 2.0), ("early_stopping", True),
                                        ("logprobs", 1), ("prompt_logprobs", 1)])
async def test_lmi_parameters_the_engine_cannot_honour_are_refused(
    http: httpx.AsyncClient, name: str, value: object
) -> None:
    body = {**LMI, "parameters": {"max_new_tokens": 3, name: value}}
    response = await http.post("/invocations", json=body)
    assert 400 <= response.status_code < 500, response.text
    assert f"`parameters.{name}` is not supported by this server." in response.text


async def test_lmi_parameters_at_their_default_and_applied_ones_are_served() -> None:
    gateway = make_gateway()
    assert isinstance(gateway.engine, FakeEngine)
    parameters = {"max_new_tokens": 3, "num_beams": 1, "length_penalty": 1.0, "logprobs": None,
                  "include_stop_str_in_output": True, "spaces_between_special_tokens": False}
    async with client(gateway, "data") as http:
        response = await http.post("/invocations", json={**LMI, "parameters": parameters})
    assert response.status_code == 200, response.text
    sampling = gateway.engine.requests[-1].sampling
    assert sampling.include_stop_str_in_output is True
    assert sampling.spaces_between_special_tokens is False


async def test_openai_spaces_between_special_tokens_reaches_the_engine() -> None:
    gateway = make_gateway()
    assert isinstance(gateway.engine, FakeEngine)
    async with client(gateway, "data") as http:
        body = {**COMPLETION, "spaces_between_special_tokens": False}
        response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert gateway.engine.requests[-1].sampling.spaces_between_special_tokens is False


async def test_typical_sampling_is_refused_on_mindie_and_accepted_on_tgi(
    http: httpx.AsyncClient,
) -> None:
    tgi = await http.post("/generate", json={"inputs": "hi", "parameters": {"typical_p": 0.95}})
    assert tgi.status_code == 200, tgi.text  # validated, not applied (LangChain sends 0.95)
    mindie = await http.post("/infer", json={"inputs": "hi", "parameters": {"typical_p": 0.5}})
    assert 400 <= mindie.status_code < 500, mindie.text
    assert "typical_p" in mindie.text
    neutral = await http.post("/infer", json={"inputs": "hi", "parameters": {"typical_p": 1.0,
                                                                              "max_new_tokens": 3}})
    assert neutral.status_code == 200, neutral.text
