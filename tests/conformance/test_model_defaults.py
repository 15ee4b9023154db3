"""The model's sampling defaults on TGI, MindIE, DJL and Triton, end to end on the real server
process and the REAL vLLM engine (the demo model's generation_config.json: temperature 0.7,
top_p 0.9, top_k 40, repetition_penalty 1.05, max_new_tokens 64).

The proofs: with a fixed seed, a request that leaves temperature out gives exactly the output
of the same request with temperature 0.7, and not the one with 1.0; a request that leaves its
output limit out gets 64 tokens; a greedy request stays greedy (its output is the request's with
temperature 0) and takes the model's repetition penalty.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from huggingface_hub import InferenceClient
from text_generation import Client

from tests.serverproc import RunningServer

pytestmark = [pytest.mark.server, pytest.mark.engine]

PROMPT = "Hello world, this is"
MODEL_LIMIT = 64
SEED = 7


@pytest.fixture(scope="module")
def http(live_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=120) as client:
        yield client


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def assert_default_temperature(texts: dict[str | float, str]) -> None:
    """`texts` by temperature ("omitted", 0.7, 1.0), all from the same seeded request."""
    assert texts["omitted"] == texts[0.7], texts
    assert texts["omitted"] != texts[1.0], texts


# ---- TGI (official clients) --------------------------------------------------------------------


def test_tgi_omitted_temperature_is_the_models(live_server: RunningServer) -> None:
    tgi = Client(live_server.url, timeout=120)

    def text(**temperature: float) -> str:
        out = tgi.generate(PROMPT, do_sample=True, seed=SEED, max_new_tokens=20, **temperature)
        return out.generated_text

    assert_default_temperature(
        {"omitted": text(), 0.7: text(temperature=0.7), 1.0: text(temperature=1.0)}
    )


def test_tgi_omitted_max_new_tokens_is_the_models(live_server: RunningServer) -> None:
    hub = InferenceClient(base_url=live_server.url, timeout=120)
    out = hub.text_generation(PROMPT, details=True, do_sample=True, seed=SEED)
    assert out.details is not None
    assert (out.details.finish_reason, out.details.generated_tokens) == ("length", MODEL_LIMIT)


def test_tgi_greedy_stays_greedy_with_the_models_repetition_penalty(http: httpx.Client) -> None:
    def text(**parameters: Any) -> str:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": MODEL_LIMIT, **parameters}}
        generated: str = post(http, "/generate", body)["generated_text"]
        return generated

    greedy = text()
    assert greedy == text(do_sample=False) == text(repetition_penalty=1.05)
    assert greedy != text(repetition_penalty=1.0)


def test_tgi_stream_takes_the_models_temperature(live_server: RunningServer) -> None:
    hub = InferenceClient(base_url=live_server.url, timeout=120)

    def streamed(**temperature: float) -> str:
        return "".join(hub.text_generation(PROMPT, stream=True, do_sample=True, seed=SEED,
                                           max_new_tokens=20, **temperature))

    assert_default_temperature(
        {"omitted": streamed(), 0.7: streamed(temperature=0.7), 1.0: streamed(temperature=1.0)}
    )


# ---- MindIE ------------------------------------------------------------------------------------


def test_mindie_infer_omitted_temperature_is_the_models(http: httpx.Client) -> None:
    def text(**temperature: float) -> str:
        parameters = {"do_sample": True, "seed": SEED, "max_new_tokens": 20, **temperature}
        out: str = post(http, "/infer", {"inputs": PROMPT, "parameters": parameters})[
            "generated_text"
        ]
        return out

    assert_default_temperature(
        {"omitted": text(), 0.7: text(temperature=0.7), 1.0: text(temperature=1.0)}
    )


def test_mindie_infer_omitted_max_new_tokens_is_the_models(http: httpx.Client) -> None:
    details = post(http, "/infer", {"inputs": PROMPT, "parameters": {"details": True}})["details"]
    assert (details["finish_reason"], details["generated_tokens"]) == ("length", MODEL_LIMIT)


def test_mindie_vllm_generate_takes_the_models_defaults(http: httpx.Client) -> None:
    def text(**fields: Any) -> str:
        out: str = post(http, "/generate", {"prompt": PROMPT, "seed": SEED, **fields})["text"][0]
        return out

    assert_default_temperature({
        "omitted": text(max_tokens=20), 0.7: text(max_tokens=20, temperature=0.7),
        1.0: text(max_tokens=20, temperature=1.0),
    })
    with_limit = text(temperature=0.7, max_tokens=MODEL_LIMIT, ignore_eos=True)
    assert text(ignore_eos=True) == with_limit != text(ignore_eos=True, max_tokens=16)


# ---- DJL ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/invocations", "/predictions/tiny"])
def test_djl_omitted_temperature_is_the_models(http: httpx.Client, path: str) -> None:
    def text(**temperature: float) -> str:
        parameters = {"do_sample": True, "seed": SEED, "max_new_tokens": 20, **temperature}
        out: str = post(http, path, {"inputs": PROMPT, "parameters": parameters})[
            "generated_text"
        ]
        return out

    assert_default_temperature(
        {"omitted": text(), 0.7: text(temperature=0.7), 1.0: text(temperature=1.0)}
    )


def test_djl_omitted_max_new_tokens_is_the_models(http: httpx.Client) -> None:
    body = {"inputs": PROMPT, "parameters": {"ignore_eos": True, "details": True}}
    details = post(http, "/invocations", body)["details"]
    assert (details["finish_reason"], details["generated_tokens"]) == ("length", MODEL_LIMIT)


def test_djl_stream_takes_the_models_limit(http: httpx.Client) -> None:
    body = {"inputs": PROMPT, "stream": True,
            "parameters": {"ignore_eos": True, "do_sample": True, "seed": SEED}}
    response = http.post("/invocations", json=body)
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert len(lines) == MODEL_LIMIT and lines[-1]["generated_text"]


# ---- Triton (tritonclient) ---------------------------------------------------------------------


def triton_infer(
    client: triton.InferenceServerClient, sampling: dict[str, Any]
) -> triton.InferResult:
    inputs = []
    for name, datatype, value in (
        ("text_input", "BYTES", np.array([PROMPT.encode()], dtype=np.object_)),
        ("sampling_parameters", "BYTES", np.array([json.dumps(sampling).encode()],
                                                  dtype=np.object_)),
        ("exclude_input_in_output", "BOOL", np.array([True], dtype=bool)),
        ("return_num_output_tokens", "BOOL", np.array([True], dtype=bool)),
    ):
        tensor = triton.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return client.infer("tiny", inputs)


@pytest.fixture(scope="module")
def tritons(live_server: RunningServer) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(f"127.0.0.1:{live_server.data_port}",
                                          network_timeout=120)
    yield client
    client.close()


def test_triton_omitted_temperature_is_the_models(
    tritons: triton.InferenceServerClient,
) -> None:
    def text(**temperature: float) -> str:
        result = triton_infer(tritons, {"seed": SEED, "max_tokens": 20, **temperature})
        out: bytes = result.as_numpy("text_output")[0]
        return out.decode(errors="replace")

    assert_default_temperature(
        {"omitted": text(), 0.7: text(temperature=0.7), 1.0: text(temperature=1.0)}
    )


def test_triton_omitted_max_tokens_is_the_models(tritons: triton.InferenceServerClient) -> None:
    result = triton_infer(tritons, {"ignore_eos": True})
    assert int(result.as_numpy("num_output_tokens")[0]) == MODEL_LIMIT  # not the backend's 16


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_triton_generate_takes_the_models_defaults(http: httpx.Client, route: str) -> None:
    def text(**parameters: Any) -> str:
        body = {"text_input": PROMPT, "exclude_input_in_output": True, "stream": False,
                "parameters": {"seed": SEED, "max_tokens": 20, **parameters}}
        response = http.post(f"/v2/models/tiny/{route}", json=body)
        assert response.status_code == 200, response.text
        payload = response.text.removeprefix("data: ") if route == "generate_stream" else (
            response.text
        )
        out: str = json.loads(payload)["text_output"]
        return out

    assert_default_temperature(
        {"omitted": text(), 0.7: text(temperature=0.7), 1.0: text(temperature=1.0)}
    )
