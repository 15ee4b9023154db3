"""DJL / SageMaker LMI answer schemas on the real server process and the REAL vLLM engine, over
plain HTTP as SageMaker clients send it (LMI has no client library):
- LMI's async-mode schema, its default (the shared `live_server`),
  djl_python/lmi_vllm/request_response_utils.py;
- the legacy rolling-batch schema on a server started with DJL's OPTION_ROLLING_BATCH=vllm
  (`djl_options_server`), djl_python/output_formatter.py.
Prompt logprobs (`decoder_input_details`) are refused on this CPU engine with LoRA enabled, so
`prefill` is proven in tests/unit/test_djl_translate.py only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.serverproc import RunningServer

pytestmark = pytest.mark.server

PROMPT = "the quick brown fox jumps over"
TOKENS = 8
FIXED = {"max_new_tokens": TOKENS, "ignore_eos_token": True}  # greedy, always TOKENS tokens


@pytest.fixture(scope="module")
def current(live_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def legacy(djl_options_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=djl_options_server.url, timeout=60) as http:
        yield http


def answer(http: httpx.Client, path: str = "/invocations", **parameters: Any) -> dict[str, Any]:
    body = {"inputs": PROMPT, "parameters": {**FIXED, **parameters}}
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    out: dict[str, Any] = response.json()
    return out


def streamed(
    http: httpx.Client, path: str = "/invocations", **parameters: Any
) -> list[dict[str, Any]]:
    body = {"inputs": PROMPT, "stream": True, "parameters": {**FIXED, **parameters}}
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/jsonlines")
        return [json.loads(line) for line in response.iter_lines() if line]


def prompt_tokens(http: httpx.Client) -> int:
    """The prompt's length as vLLM counts it (OpenAI completions usage, same engine)."""
    usage = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()["usage"]
    count: int = usage["prompt_tokens"]
    return count


# ---- LMI's async mode: the default ---------------------------------------------------------------

def test_default_answer_is_the_async_schema(current: httpx.Client) -> None:
    plain = answer(current)
    assert list(plain) == ["generated_text"] and plain["generated_text"]
    detailed = answer(current, details=True, seed=11)
    details = detailed["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"]
    assert (details["finish_reason"], details["seed"], details["prefill"]) == ("length", 11, [])
    assert details["generated_tokens"] == len(details["tokens"]) == TOKENS
    assert all(set(t) == {"id", "text", "logprob"} for t in details["tokens"])
    assert all(isinstance(t["logprob"], float) and t["logprob"] <= 0 for t in details["tokens"])
    assert detailed["generated_text"] == plain["generated_text"]


def test_default_stream_lines_are_the_async_schema(current: httpx.Client) -> None:
    lines = streamed(current, details=True, return_full_text=True)
    assert len(lines) == TOKENS
    for line in lines[:-1]:
        assert list(line) == ["index", "token", "generated_text", "details"]
        assert line["index"] == 0 and line["generated_text"] is None and line["details"] is None
    assert all(set(line["token"]) == {"id", "text", "logprob"} for line in lines)
    assert all(isinstance(line["token"]["logprob"], float) for line in lines)
    text = "".join(line["token"]["text"] for line in lines)
    assert lines[-1]["generated_text"] == PROMPT + text
    assert lines[-1]["details"] == {"finish_reason": "length", "seed": None,
                                    "generated_tokens": TOKENS,
                                    "input_length": prompt_tokens(current)}
    assert text == answer(current)["generated_text"]


@pytest.mark.parametrize("inputs", [PROMPT, [PROMPT, "hello"]])
def test_decoder_input_details_are_refused_alike_for_one_input_and_a_list(
    current: httpx.Client, inputs: str | list[str]
) -> None:
    """A list asks for each input's prefill as one input does (LMI runs a list's inputs as
    separate requests), so on this engine both are refused, never answered `prefill: []`."""
    body = {"inputs": inputs, "parameters": {**FIXED, "details": True,
                                             "decoder_input_details": True}}
    response = current.post("/invocations", json=body)
    assert response.status_code == 424, response.text
    assert "Prompt logprobs" in response.text
    assert answer(current)["generated_text"]  # the engine serves on


# ---- option.rolling_batch=vllm: the legacy rolling-batch schema ----------------------------------

def test_rolling_batch_answer_is_the_legacy_schema(
    legacy: httpx.Client, current: httpx.Client
) -> None:
    out = answer(legacy, "/predictions/tiny", details=True)
    details = out["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "inputs", "tokens"]
    assert (details["finish_reason"], details["inputs"]) == ("length", PROMPT)
    assert all(set(t) == {"id", "text", "log_prob"} for t in details["tokens"])
    assert all(isinstance(t["log_prob"], float) for t in details["tokens"])
    assert out["generated_text"] == answer(current)["generated_text"]  # same greedy text


def test_rolling_batch_stream_lines_are_the_legacy_schema(legacy: httpx.Client) -> None:
    lines = streamed(legacy, "/predictions/tiny", details=True)  # (its /invocations is TGI's)
    assert all(list(line) == ["token"] for line in lines[:-1])
    assert all(set(line["token"]) == {"id", "text", "log_prob"} for line in lines)
    assert lines[-1]["generated_text"] == "".join(line["token"]["text"] for line in lines)
    assert lines[-1]["details"] == {"finish_reason": "length", "generated_tokens": TOKENS,
                                    "inputs": PROMPT}
