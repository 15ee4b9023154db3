"""The model's sampling defaults on the non-OpenAI protocols, through the in-process gateway on
the fake engine, whose model folder has a generation_config.json (the demo model's values:
temperature 0.7, top_p 0.9, top_k 40, repetition_penalty 1.05, max_new_tokens 64).

What each route sent to the engine is read back from the fake engine. Real-engine proofs:
tests/conformance/test_model_defaults.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from server.core.engine import fit_prompt
from server.core.types import GenerationRequest, Sampling
from server.engines.fake import FakeEngine
from tests.unit.demo_kit import model_with_defaults
from tests.unit.gateway_kit import client, make_gateway

pytestmark = pytest.mark.anyio

MODEL = (0.7, 0.9, 40, 1.05)  # temperature, top_p, top_k, repetition_penalty
GREEDY = (0.0, 1.0, 0, 1.05)  # greedy keeps its warpers, takes the penalty
TEXT_INPUT = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a b c"]}


@dataclass
class Gw:
    http: httpx.AsyncClient
    engine: FakeEngine

    @property
    def sent(self) -> GenerationRequest:
        return self.engine.requests[-1]

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        response = await self.http.post(path, json=body)
        assert response.status_code == 200, response.text
        return response


@pytest.fixture
async def gw() -> AsyncIterator[Gw]:
    gateway = make_gateway(model_path=model_with_defaults())
    assert isinstance(gateway.engine, FakeEngine)
    async with client(gateway, "data") as http:
        yield Gw(http, gateway.engine)


def knobs(sampling: Sampling) -> tuple[float, float, int, float]:
    return (sampling.temperature, sampling.top_p, sampling.top_k, sampling.repetition_penalty)


async def test_the_service_reports_the_models_defaults(gw: Gw) -> None:
    defaults = gw.engine.info().defaults
    assert (defaults.temperature, defaults.max_new_tokens, defaults.min_p) == (0.7, 64, None)


# ---- TGI -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
async def test_tgi_sampled_request_takes_the_model_defaults(gw: Gw, path: str) -> None:
    await gw.post(path, {"inputs": "a b c", "parameters": {"do_sample": True}})
    assert knobs(gw.sent.sampling) == MODEL
    # the engine's prompt budget applies the model's 64 within the room, as TGI's router
    assert fit_prompt(gw.sent, gw.engine.info(), prompt_tokens=3).max_tokens == 64


async def test_tgi_without_parameters_samples_with_the_model_defaults(gw: Gw) -> None:
    body = (await gw.post("/generate", {"inputs": "a b c"})).json()
    assert knobs(gw.sent.sampling) == MODEL
    assert len(body["generated_text"].split()) == 64


async def test_tgi_greedy_keeps_temperature_zero(gw: Gw) -> None:
    await gw.post("/generate", {"inputs": "a b c", "parameters": {"max_new_tokens": 5}})
    assert knobs(gw.sent.sampling) == GREEDY and gw.sent.sampling.max_new_tokens == 5


async def test_tgi_values_given_win(gw: Gw) -> None:
    given = {"temperature": 0.3, "top_p": 0.5, "top_k": 2, "repetition_penalty": 1.2}
    await gw.post("/generate", {"inputs": "a b c", "parameters": given})
    assert knobs(gw.sent.sampling) == (0.3, 0.5, 2, 1.2)


# ---- MindIE --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_mindie_infer_sampled_takes_the_model_defaults(gw: Gw, stream: bool) -> None:
    body = {"inputs": "a b c", "stream": stream, "parameters": {"do_sample": True}}
    await gw.post("/infer", body)
    assert knobs(gw.sent.sampling) == MODEL and gw.sent.sampling.max_new_tokens is None


async def test_mindie_infer_greedy_by_default_with_the_models_limit(gw: Gw) -> None:
    body = (await gw.post("/infer", {"inputs": "a b c"})).json()
    assert knobs(gw.sent.sampling) == GREEDY
    assert len(body["generated_text"].split()) == 64  # not MindIE's 20


async def test_mindie_infer_token_takes_the_model_defaults(gw: Gw) -> None:
    await gw.post("/infer_token", {"input_id": [5, 6, 7], "parameters": {"top_k": 3}})
    assert knobs(gw.sent.sampling) == (0.7, 0.9, 3, 1.05)


async def test_mindie_vllm_generate_takes_the_model_defaults(gw: Gw) -> None:
    body = (await gw.post("/generate", {"prompt": "a b c"})).json()
    assert knobs(gw.sent.sampling) == MODEL
    assert len(body["text"][0].split()) == 3 + 64  # "<prompt> <completion>", not vLLM's 16
    await gw.post("/generate", {"prompt": "a b c", "temperature": 0, "max_tokens": 4})
    assert gw.sent.sampling.temperature == 0 and gw.sent.sampling.max_new_tokens == 4


# ---- DJL -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/invocations", "/predictions/tiny"])
async def test_djl_sampled_request_takes_the_model_defaults(gw: Gw, path: str) -> None:
    body = (await gw.post(path, {"inputs": "a b c", "parameters": {"do_sample": True}})).json()
    assert knobs(gw.sent.sampling) == MODEL
    assert len(body["generated_text"].split()) == 64  # not LMI's 30


async def test_djl_greedy_by_default_keeps_temperature_zero(gw: Gw) -> None:
    await gw.post("/invocations", {"inputs": "a b c", "parameters": {"max_new_tokens": 3}})
    assert knobs(gw.sent.sampling) == GREEDY and gw.sent.sampling.max_new_tokens == 3


async def test_djl_stream_takes_the_model_defaults(gw: Gw) -> None:
    response = await gw.post("/invocations", {"inputs": "a b c", "stream": True,
                                              "parameters": {"temperature": 0.5}})
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert knobs(gw.sent.sampling) == (0.5, 0.9, 40, 1.05) and len(lines) == 64


# ---- Triton --------------------------------------------------------------------------------------


async def test_triton_infer_takes_the_model_defaults(gw: Gw) -> None:
    await gw.post("/v2/models/tiny/infer", {"inputs": [TEXT_INPUT]})
    assert knobs(gw.sent.sampling) == MODEL and gw.sent.sampling.max_new_tokens is None


async def test_triton_token_infer_takes_the_model_defaults(gw: Gw) -> None:
    body = {"inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32",
                        "data": [5, 6, 7], "parameters": {"do_sample": False}}]}
    response = await gw.post("/v2/models/tiny/infer", body)
    assert knobs(gw.sent.sampling) == GREEDY
    assert response.json()["outputs"][0]["shape"] == [1, 64]  # not MindIE's 20


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
async def test_triton_generate_takes_the_model_defaults(gw: Gw, route: str) -> None:
    await gw.post(f"/v2/models/tiny/{route}", {"text_input": "a b c",
                                               "parameters": {"top_p": 0.5}})
    assert knobs(gw.sent.sampling) == (0.7, 0.5, 40, 1.05)


async def test_triton_sampling_parameters_tensor_and_defaults(gw: Gw) -> None:
    tensor = {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES",
              "data": [json.dumps({"temperature": 0.2, "max_tokens": 4})]}
    body = (await gw.post("/v2/models/tiny/infer", {"inputs": [TEXT_INPUT, tensor]})).json()
    assert knobs(gw.sent.sampling) == (0.2, 0.9, 40, 1.05)
    assert gw.sent.sampling.max_new_tokens == 4
    completion = body["outputs"][0]["data"][0].removeprefix("a b c")  # prompt + completion
    assert len(completion.split()) == 4
