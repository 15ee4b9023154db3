"""MindIE's native inference routes on the real server process and the REAL vLLM engine, over raw
HTTP (MindIE has no client library): /infer, /infer_token, /v1/tokenizer, both flavours of
/generate, stream framing, cancellation by request id, and every validation error."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.serverproc import RunningServer

PROMPT = "Hello world, this is"


@pytest.fixture(scope="module")
def http(live_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=60) as client:
        yield client


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def tgi_text(http: httpx.Client, max_new_tokens: int) -> str:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": max_new_tokens}}
    text: str = post(http, "/generate", body)["generated_text"]
    return text


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    frames = response.text.split("\n\n")
    assert frames[-1] == ""
    assert all(frame.startswith("data: ") for frame in frames[:-1]), frames
    return [json.loads(frame[len("data: ") :]) for frame in frames[:-1]]


def assert_mindie_error(response: httpx.Response, status: int, reason: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == reason
    message: str = body["error"]
    return message


# ---- /infer and /infer_token ---------------------------------------------------------------


def test_infer_is_greedy_by_default_and_reports_details(http: httpx.Client) -> None:
    out = post(
        http, "/infer", {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True}}
    )
    assert out["generated_text"] == tgi_text(http, 6)
    details = out["details"]
    assert details["generated_tokens"] == len(details["generated_token_ids"]) <= 6
    assert details["finish_reason"] in {"length", "eos_token"} and details["seed"] is None


def test_infer_without_details_returns_only_the_text(http: httpx.Client) -> None:
    out = post(http, "/infer", {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert set(out) == {"generated_text"}


def test_infer_defaults_to_the_models_max_new_tokens(http: httpx.Client) -> None:
    """The demo model's generation_config says 64 (MindIE's own default, 20, is for a model
    that says nothing)."""
    out = post(http, "/infer", {"inputs": PROMPT, "parameters": {"details": True}})
    assert out["details"]["generated_tokens"] <= 64
    assert out["details"]["finish_reason"] != "length" or out["details"]["generated_tokens"] == 64


def test_infer_stream_framing_and_timings(http: httpx.Client) -> None:
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 5, "details": True}}
    response = http.post("/infer", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in response.text
    events = sse_events(response)
    first, middle, last = events[0], events[1:-1], events[-1]
    assert first["prefill_time"] > 0 and first["decode_time"] is None
    assert set(first) == {"prefill_time", "decode_time", "token"}
    assert all(e["prefill_time"] is None and e["decode_time"] >= 0 for e in middle)
    assert list(last) == ["prefill_time", "decode_time", "generated_text", "details", "token"]
    assert last["token"]["text"] is None and isinstance(last["token"]["id"], int)
    assert last["generated_text"] == tgi_text(http, 5)
    assert last["details"]["generated_tokens"] == len(events)


def test_infer_token_takes_and_gives_token_ids(http: httpx.Client) -> None:
    ids = [t["id"] for t in http.post("/tokenize", json={"inputs": PROMPT}).json()]
    by_ids = post(
        http,
        "/infer_token",
        {"input_id": ids, "parameters": {"max_new_tokens": 5, "details": True}},
    )
    by_text = post(
        http, "/infer", {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}}
    )
    assert by_ids == by_text


def test_infer_stream_is_cancelled_by_its_id(
    http: httpx.Client, live_server: RunningServer
) -> None:
    body = {
        "id": "mindie-cancel-1",
        "inputs": PROMPT,
        "stream": True,
        "parameters": {"max_new_tokens": 400, "details": True},
    }
    events: list[str] = []

    def consume() -> None:
        with (
            httpx.Client(base_url=live_server.url, timeout=60) as client,
            client.stream("POST", "/infer", json=body) as response,
        ):
            events.extend(line for line in response.iter_lines() if line)

    reader = threading.Thread(target=consume)
    reader.start()
    deadline = time.monotonic() + 30
    stopped = None
    while time.monotonic() < deadline:
        stopped = http.post("/v2/models/tiny/stopInfer", json={"id": "mindie-cancel-1"})
        if stopped.status_code == 200:
            break
        time.sleep(0.05)
    reader.join(60)
    assert stopped is not None and stopped.status_code == 200, stopped and stopped.text
    final = json.loads(events[-1][len("data: ") :])
    assert final["details"]["finish_reason"] == "stop_sequence"
    assert final["details"]["generated_tokens"] < 400


MINDIE_ID_RULE = (
    "The id can contain only digits, letters, underscores(_), hyphens(-) and no more than 256 "
    "words in length."
)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"id": "req.1"}', MINDIE_ID_RULE),
        (b'{"id": "a b"}', MINDIE_ID_RULE),
        (json.dumps({"id": "x" * 257}).encode(), MINDIE_ID_RULE),
        (b'{"id": ""}', MINDIE_ID_RULE),
        (b'{"id": 7}', "id must be string type."),
        (b'{"other": "x"}', "Not found id."),
        (b"{not json", "Failed to parse context to json body."),
    ],
)
def test_stop_infer_refuses_ids_outside_mindies_pattern_with_422(
    http: httpx.Client, content: bytes, message: str
) -> None:
    """What `curl -X POST …/stopInfer -H 'Content-Type: application/json' -d '<body>'` gets."""
    response = http.post(
        "/v2/models/tiny/stopInfer", content=content,
        headers={"content-type": "application/json"},
    )
    assert assert_mindie_error(response, 422, "Input Validation Error") == message
    assert post(http, "/infer", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})


def test_stop_infer_with_a_well_formed_unknown_id_is_mindies_404(http: httpx.Client) -> None:
    response = http.post("/v2/models/tiny/stopInfer", json={"id": "no-such_request-9"})
    message = assert_mindie_error(response, 404, "NotFoundError")
    assert message == "RequestId is no-such_request-9 not found."


# ---- /v1/tokenizer -------------------------------------------------------------------------


def test_tokenizer_counts_and_decodes_tokens(http: httpx.Client) -> None:
    out = post(http, "/v1/tokenizer", {"inputs": PROMPT})
    assert out["token_number"] == len(out["tokens"]) > 1
    assert "".join(out["tokens"][1:]) == PROMPT  # after the BOS token
    quiet = post(http, "/v1/tokenizer", {"inputs": PROMPT, "do_decode": False})
    assert quiet == {"token_number": out["token_number"], "tokens": []}


# ---- /generate: both flavours --------------------------------------------------------------


def test_generate_with_prompt_is_the_vllm_flavour(http: httpx.Client) -> None:
    out = post(http, "/generate", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    assert out == {"text": [PROMPT + " " + tgi_text(http, 6)]}


def test_generate_vllm_flavour_streams_nul_terminated_chunks(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    response = http.post("/generate", json=body)
    assert response.status_code == 200
    chunks = response.content.split(b"\0")
    assert chunks[-1] == b""
    texts = [json.loads(chunk)["text"] for chunk in chunks[:-1]]
    assert all(len(t) == 1 for t in texts)
    assert "".join(t[0] for t in texts) == tgi_text(http, 6)


def test_generate_vllm_flavour_runs_n_choices_and_adapters(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "n": 2, "seed": 3, "temperature": 1.0}
    out = post(http, "/generate", body)
    assert len(out["text"]) == 2 and all(t.startswith(PROMPT + " ") for t in out["text"])
    lora = post(
        http, "/generate", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "model": "a1"}
    )
    completion = post(
        http,
        "/v1/completions",
        {"model": "a1", "prompt": PROMPT, "max_tokens": 5, "temperature": 0},
    )
    assert lora["text"] == [PROMPT + " " + completion["choices"][0]["text"]]


def test_generate_with_inputs_is_the_tgi_flavour(http: httpx.Client) -> None:
    out = post(http, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
    assert set(out) == {"generated_text"}


# ---- bad input -----------------------------------------------------------------------------

VALIDATION = "Input Validation Error"


@pytest.mark.parametrize("path", ["/infer", "/infer_token"])
@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"inputs": PROMPT, "input_id": [1, 2]}, "Input conflict."),
        ({}, "Not found inputs."),
        ({"inputs": 5}, "The type of inputs is abnormal"),
        ({"inputs": ""}, "Inputs must be necessary"),
        ({"input_id": "1 2"}, "Parameter input_id must be an array"),
        ({"input_id": [1, 2_000_000]}, "Data element in param input_id is invalid"),
        ({"inputs": PROMPT, "stream": "yes"}, "stream"),
        ({"inputs": PROMPT, "parameters": {"temperature": 0}}, "Parameter temperature"),
        ({"inputs": PROMPT, "parameters": {"top_p": 1.0}}, "top_p must be in (0.0,1.0], got 1.0"),
        ({"inputs": PROMPT, "parameters": {"top_k": 0}}, "Parameter top_k"),
        ({"inputs": PROMPT, "parameters": {"max_new_tokens": 0}}, "Parameter max_new_tokens"),
        ({"inputs": PROMPT, "parameters": {"max_new_tokens": 600}}, "maximum context length"),
        ({"inputs": PROMPT, "parameters": {"priority": 9}}, "Parameter priority"),
        ({"inputs": PROMPT, "parameters": {"timeout": 0}}, "Parameter timeout"),
        ({"inputs": PROMPT, "parameters": {"watermark": True}}, "watermark"),
        ({"inputs": PROMPT, "parameters": {"details": 1}}, "parameters.details"),
        ({"inputs": PROMPT, "parameters": "fast"}, "parameters"),
        ({"inputs": PROMPT, "id": "bad id!"}, "id"),
    ],
)
def test_infer_bad_input_is_422(
    http: httpx.Client, path: str, body: dict[str, Any], fragment: str
) -> None:
    assert fragment in assert_mindie_error(http.post(path, json=body), 422, VALIDATION)


@pytest.mark.parametrize("path", ["/infer", "/infer_token", "/generate", "/v1/tokenizer"])
@pytest.mark.parametrize("content", [b"{not json", b"", b"[1]"])
def test_malformed_json_is_422(http: httpx.Client, path: str, content: bytes) -> None:
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert "error" in response.json()


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"prompt": ""}, "Prompt must be necessary"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": PROMPT, "max_tokens": 0}, "Parameter max_tokens"),
        ({"prompt": PROMPT, "n": 0}, "Parameter [n]"),
        ({"prompt": PROMPT, "temperature": -1}, "Parameter temperature must be in (0.0,"),
        ({"prompt": PROMPT, "top_p": 1.5}, "Parameter top_p"),
        ({"prompt": PROMPT, "stop": ["x"] * 20}, "stop"),
        ({"prompt": PROMPT, "stop": [""]}, "`stop` must be list[string] if list"),
        ({"prompt": PROMPT, "frequency_penalty": 3}, "frequency_penalty"),
        ({"prompt": PROMPT, "best_of": 1, "n": 2}, "best_of should greater than or equal to n"),
        ({"prompt": PROMPT, "n": 2}, "Best_of/N can not greater than 1 when temperature is 0"),
        ({"prompt": PROMPT, "stop_token_ids": "2"}, "stop_token_ids"),
    ],
)
def test_generate_vllm_flavour_bad_input_is_422(
    http: httpx.Client, body: dict[str, Any], fragment: str
) -> None:
    assert fragment in assert_mindie_error(http.post("/generate", json=body), 422, VALIDATION)


# Keys MindIE's handlers do not read (single_req_self_develop_infer_interface.cpp and
# single_req_vllm_infer_interface.cpp, `SetupInferParams`): ignored, as MindIE ignores them.
@pytest.mark.parametrize(
    "ignored",
    [
        {"stop": [""]},
        {"stop_token_ids": [10**9]},
        {"truncate": 0},
        {"top_n_tokens": 1000},
        {"decoder_input_details": True},
    ],
)
def test_infer_ignores_what_mindie_does_not_read(
    http: httpx.Client, ignored: dict[str, Any]
) -> None:
    parameters = {"max_new_tokens": 3, "details": True}
    baseline = post(http, "/infer", {"inputs": PROMPT, "parameters": parameters})
    out = post(http, "/infer", {"inputs": PROMPT, "parameters": {**parameters, **ignored}})
    assert out == baseline


@pytest.mark.parametrize(
    "ignored",
    [
        {"prompt_logprobs": 1, "model": "a1"},  # never asked: it would kill the CPU LoRA engine
        {"logprobs": 1000},
        {"logit_bias": {"5": 100}},
        {"allowed_token_ids": [10**9]},
        {"min_tokens": 10},
        {"use_beam_search": True},
    ],
)
def test_generate_vllm_flavour_ignores_what_mindie_does_not_read(
    http: httpx.Client, ignored: dict[str, Any]
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "model": ignored.get("model")}
    baseline = post(http, "/generate", body)
    assert post(http, "/generate", {**body, **ignored}) == baseline


def test_generate_vllm_flavour_stop_token_ids_past_the_vocabulary_stop_nothing(
    http: httpx.Client,
) -> None:
    """MindIE applies any id in [0, INT32_MAX] and drops the others; vLLM refuses ids past the
    vocabulary (was a 422 here), which can never be generated, so they are dropped too."""
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    out = post(http, "/generate", {**body, "stop_token_ids": [-1, 10**9, 2**40]})
    assert out == post(http, "/generate", body)


def test_generate_vllm_flavour_unknown_model_is_404(http: httpx.Client) -> None:
    response = http.post("/generate", json={"prompt": PROMPT, "model": "no-such-lora"})
    assert_mindie_error(response, 404, "NotFoundError")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({}, "Inputs in request body is invalid."),
        ({"inputs": 3}, "Inputs in request body"),
        ({"inputs": ""}, "the length of inputs is 0"),
    ],
)
def test_tokenizer_bad_input_is_422(
    http: httpx.Client, body: dict[str, Any], fragment: str
) -> None:
    assert fragment in assert_mindie_error(http.post("/v1/tokenizer", json=body), 422, VALIDATION)


def test_the_engine_keeps_serving_after_bad_input(http: httpx.Client) -> None:
    http.post("/infer", json={"inputs": PROMPT, "input_id": [1]})
    http.post("/generate", json={"prompt": PROMPT, "n": 10_000})
    http.post("/generate", json={"prompt": PROMPT, "prompt_logprobs": 1, "model": "a1"})
    http.post("/infer", content=b"{")
    assert post(http, "/infer", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
