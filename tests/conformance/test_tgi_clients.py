"""TGI's native routes on the real server process and the REAL vLLM engine, through TGI's official
clients (`huggingface_hub.InferenceClient`, `text_generation.Client`) and raw HTTP for shapes,
framing and every validation error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError as HubValidationError
from text_generation import Client
from text_generation.errors import ValidationError as TgiValidationError
from text_generation.types import Message

from tests.serverproc import RunningServer

PROMPT = "Hello world, this is"


@pytest.fixture(scope="module")
def http(live_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def hub(live_server: RunningServer) -> InferenceClient:
    return InferenceClient(base_url=live_server.url, timeout=60)


@pytest.fixture(scope="module")
def tgi(live_server: RunningServer) -> Client:
    return Client(live_server.url, timeout=60)


def generate(http: httpx.Client, **parameters: Any) -> dict[str, Any]:
    response = http.post("/generate", json={"inputs": PROMPT, "parameters": parameters})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    frames = response.text.split("\n\n")
    assert frames[-1] == "", "the stream must end with a blank line"
    assert all(frame.startswith("data: ") for frame in frames[:-1]), frames
    return [json.loads(frame[len("data: ") :]) for frame in frames[:-1]]


def assert_validation_error(response: httpx.Response, status: int = 422) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == "validation"
    message: str = body["error"]
    return message


# ---- official clients ----------------------------------------------------------------------


def test_hub_client_gets_the_full_text_by_default_as_from_tgi(
    hub: InferenceClient, http: httpx.Client
) -> None:
    """The hub client posts to `POST /`, where TGI defaults `return_full_text` to true for a
    text-generation model (server.rs `compat_generate`); `/generate` defaults it to false."""
    plain = generate(http, max_new_tokens=8)["generated_text"]
    assert plain
    assert hub.text_generation(PROMPT, max_new_tokens=8) == PROMPT + plain
    assert hub.text_generation(PROMPT, max_new_tokens=8, return_full_text=False) == plain


def test_hub_client_details_list_every_token(hub: InferenceClient) -> None:
    out = hub.text_generation(PROMPT, max_new_tokens=6, details=True)
    details = out.details
    assert details is not None
    assert details.finish_reason in {"length", "eos_token", "stop_sequence"}
    assert details.generated_tokens == len(details.tokens) <= 6
    assert all(isinstance(t.logprob, float) and t.logprob <= 0 for t in details.tokens)
    assert all(isinstance(t.id, int) and isinstance(t.special, bool) for t in details.tokens)


def test_hub_client_stream_joins_to_the_non_streamed_text(hub: InferenceClient) -> None:
    full = hub.text_generation(PROMPT, max_new_tokens=12)
    pieces = list(hub.text_generation(PROMPT, max_new_tokens=12, stream=True))
    assert len(pieces) <= 12
    assert PROMPT + "".join(pieces) == full  # tokens are the new text; the full text has the prompt


def test_hub_client_stream_details_end_with_generated_text(hub: InferenceClient) -> None:
    outputs = list(hub.text_generation(PROMPT, max_new_tokens=5, stream=True, details=True))
    assert all(o.generated_text is None for o in outputs[:-1])
    last = outputs[-1]
    assert last.generated_text == PROMPT + "".join(o.token.text for o in outputs)
    assert last.details is not None and last.details.generated_tokens == len(outputs)


def test_adapter_id_runs_the_lora_like_the_openai_route(
    hub: InferenceClient, http: httpx.Client
) -> None:
    text = hub.text_generation(PROMPT, max_new_tokens=10, adapter_id="a1", return_full_text=False)
    completion = http.post(
        "/v1/completions",
        json={"model": "a1", "prompt": PROMPT, "max_tokens": 10, "temperature": 0},
    )
    assert completion.status_code == 200, completion.text
    assert text == completion.json()["choices"][0]["text"]


def test_unknown_adapter_id_is_a_validation_error_for_the_hub_client(hub: InferenceClient) -> None:
    with pytest.raises(HubValidationError, match="not a loaded adapter"):
        hub.text_generation(PROMPT, max_new_tokens=4, adapter_id="no-such-adapter")


def test_text_generation_client_generate_and_stream_agree(tgi: Client) -> None:
    response = tgi.generate(PROMPT, max_new_tokens=10)
    assert response.details.generated_tokens == len(response.details.tokens)
    tokens = list(tgi.generate_stream(PROMPT, max_new_tokens=10))
    assert tokens[-1].generated_text == response.generated_text
    assert "".join(t.token.text for t in tokens) == response.generated_text
    assert tokens[-1].details is not None
    assert tokens[-1].details.finish_reason == response.details.finish_reason


def test_text_generation_client_chat_parses_the_reply(
    tgi: Client, hub: InferenceClient, http: httpx.Client
) -> None:
    """The client sends model "tgi" and types `system_fingerprint` a string (TGI's router
    fills it, on every streamed chunk too: read through the hub client, as text_generation's
    own stream model wants a `tool_calls` key TGI's text chunks lack); other clients get vLLM's,
    on the stream's last chunk only."""
    reply = tgi.chat([Message(role="user", content=PROMPT)], max_tokens=4, temperature=0)
    assert reply.choices[0].message.content is not None and reply.usage["completion_tokens"] <= 4
    assert reply.system_fingerprint.endswith("-native")
    chunks = list(hub.chat_completion([{"role": "user", "content": PROMPT}], model="tgi",
                                      max_tokens=4, temperature=0, stream=True))
    assert len(chunks) >= 2
    assert all(chunk.system_fingerprint == reply.system_fingerprint for chunk in chunks)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert streamed == reply.choices[0].message.content
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
    vllm_fingerprint = http.post("/v1/chat/completions", json=body).json()["system_fingerprint"]
    assert vllm_fingerprint.startswith("vllm-")
    vllm = http.post("/v1/chat/completions", json={**body, "stream": True})
    assert vllm.text.count('"system_fingerprint"') == 1  # vLLM stamps the last chunk only
    assert f'"system_fingerprint":"{vllm_fingerprint}"}}' in vllm.text


def test_max_new_tokens_is_checked_as_tgis_router_does(
    tgi: Client, hub: InferenceClient, http: httpx.Client
) -> None:
    """validation.rs: prompt + min(max_new_tokens, 1024) must fit the 512-token context; the
    message names the tokens it counted."""
    probe = http.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 1}})
    prompt_tokens = int(probe.headers["x-prompt-tokens"])
    expected = (
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 512. "
        f"Given: {prompt_tokens} `inputs` tokens and 1024 `max_new_tokens`"
    )
    with pytest.raises(TgiValidationError) as caught:
        tgi.generate(PROMPT, max_new_tokens=100_000)
    assert str(caught.value) == expected
    with pytest.raises(HubValidationError, match="and 600 `max_new_tokens`"):
        hub.text_generation(PROMPT, max_new_tokens=600)
    fits = tgi.generate(PROMPT, max_new_tokens=512 - prompt_tokens)
    assert fits.details.generated_tokens <= 512 - prompt_tokens


def test_text_generation_client_maps_server_validation(tgi: Client) -> None:
    with pytest.raises(TgiValidationError, match="stop sequences"):
        tgi.generate(PROMPT, max_new_tokens=4, stop_sequences=["a", "b", "c", "d", "e"])


# ---- shapes and framing ---------------------------------------------------------------------


def test_generate_returns_an_object_and_compat_a_one_element_list(http: httpx.Client) -> None:
    body: dict[str, Any] = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}
    obj = http.post("/generate", json=body)
    listed = http.post("/", json=body)
    assert obj.status_code == listed.status_code == 200
    assert set(obj.json()) == {"generated_text"}
    assert listed.json() == [{"generated_text": PROMPT + obj.json()["generated_text"]}]
    body["parameters"]["return_full_text"] = False
    assert http.post("/", json=body).json() == [obj.json()]


def test_generate_sends_tgi_timing_headers(http: httpx.Client) -> None:
    response = http.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert response.headers["x-generated-tokens"] == "3"
    for name in ("x-compute-type", "x-compute-time", "x-total-time", "x-prompt-tokens"):
        assert name in response.headers


def test_generate_stream_framing_has_no_done_marker(http: httpx.Client) -> None:
    response = http.post(
        "/generate_stream",
        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True}},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in response.text
    events = sse_events(response)
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert events[-1]["details"]["input_length"] > 0
    assert set(events[0]["token"]) == {"id", "text", "logprob", "special"}


def test_compat_route_streams_when_asked(http: httpx.Client) -> None:
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 4}}
    response = http.post("/", json=body)
    events = sse_events(response)
    assert events[-1]["generated_text"] == PROMPT + generate(http, max_new_tokens=4)[
        "generated_text"
    ]


def test_return_full_text_prepends_the_prompt(http: httpx.Client) -> None:
    plain = generate(http, max_new_tokens=4)["generated_text"]
    assert generate(http, max_new_tokens=4, return_full_text=True)["generated_text"] == (
        PROMPT + plain
    )


def test_stop_sequence_ends_the_text_with_it(http: httpx.Client) -> None:
    text = generate(http, max_new_tokens=24)["generated_text"]
    start = next(i for i in range(2, len(text) - 1) if text[i : i + 2].isascii())
    stop = text[start : start + 2]
    out = generate(http, max_new_tokens=24, stop=[stop], details=True)
    assert out["generated_text"] == text[: text.index(stop) + len(stop)]
    assert out["details"]["finish_reason"] == "stop_sequence"


def test_best_of_returns_the_other_sequence(http: httpx.Client) -> None:
    out = generate(http, max_new_tokens=4, best_of=2, do_sample=True, details=True)
    assert len(out["details"]["best_of_sequences"]) == 1
    assert out["details"]["best_of_sequences"][0]["generated_tokens"] <= 4


def test_top_n_tokens_are_reported(http: httpx.Client) -> None:
    out = generate(http, max_new_tokens=3, details=True, top_n_tokens=2)
    assert [len(top) for top in out["details"]["top_tokens"]] == [2, 2, 2]


def test_decoder_input_details_give_prefill_or_a_validation_error(http: httpx.Client) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "decoder_input_details": True}}
    response = http.post("/generate", json=body)
    if response.status_code == 422:  # this engine refuses prompt logprobs while LoRA is on
        assert "Prompt logprobs" in assert_validation_error(response)
        return
    prefill = response.json()["details"]["prefill"]
    assert prefill[0]["logprob"] is None and len(prefill) == int(
        response.headers["x-prompt-tokens"]
    )


def test_tokenize_offsets_point_into_the_input(http: httpx.Client) -> None:
    text = "Hello world, héllo"
    tokens = http.post("/tokenize", json={"inputs": text}).json()
    raw = text.encode()
    assert tokens[0]["id"] == 1 and tokens[0]["text"] == ""  # BOS covers nothing
    for token in tokens:
        assert raw[token["start"] : token["stop"]].decode(errors="replace") == token["text"]
    assert tokens[-1]["stop"] == len(raw)


def test_info_reports_real_limits(http: httpx.Client, live_server: RunningServer) -> None:
    info = http.get("/info").json()
    assert info["model_id"] == "tiny"
    assert info["max_total_tokens"] == 512 and info["max_input_tokens"] == 511
    assert info["max_best_of"] == 2 and info["max_stop_sequences"] == 4
    assert info["models"][0]["model_id"] == "tiny" and info["max_batch_total_tokens"] > 0


def test_health_routes(http: httpx.Client) -> None:
    for path in ("/health", "/"):
        response = http.get(path)
        assert response.status_code == 200 and response.content == b""


# ---- bad input ------------------------------------------------------------------------------

BAD_PARAMETERS = [
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"typical_p": 1.5}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"max_new_tokens": 600}, "`inputs` tokens + `max_new_tokens` must be <= 512"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "supports up to 4 stop sequences"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2"),
    ({"best_of": 2}, "you must use sampling"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5"),
    ({"truncate": 600}, "`truncate` must be strictly positive"),
    ({"adapter_id": "no-such-adapter"}, "not a loaded adapter"),
    ({"watermark": True}, "watermark"),
    ({"temperature": "hot"}, "parameters.temperature"),
    ({"max_new_tokens": -1}, "parameters.max_new_tokens"),
    ({"details": "yes"}, "parameters.details"),
]


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
@pytest.mark.parametrize(("parameters", "fragment"), BAD_PARAMETERS)
def test_bad_parameters_are_422_validation_on_every_route(
    http: httpx.Client, path: str, parameters: dict[str, Any], fragment: str
) -> None:
    response = http.post(path, json={"inputs": PROMPT, "parameters": parameters})
    message = assert_validation_error(response)
    if path == "/generate_stream" and "best_of" in parameters:
        fragment = "`best_of` != 1 is not supported when streaming tokens"
    assert message.startswith("Input validation error: ") and fragment in message


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/", "/tokenize"])
@pytest.mark.parametrize(
    "content",
    [b"{not json", b"", b"[1, 2]", b'{"inputs": 5}', b'{"parameters": {}}', b'{"inputs": ""}'],
)
def test_malformed_bodies_are_422_validation(http: httpx.Client, path: str, content: bytes) -> None:
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    assert_validation_error(response)


@pytest.mark.parametrize(
    "parameters", [{"best_of": 2, "do_sample": True}, {"decoder_input_details": True}]
)
def test_stream_only_limits_are_refused_before_streaming(
    http: httpx.Client, parameters: dict[str, Any]
) -> None:
    response = http.post("/generate_stream", json={"inputs": PROMPT, "parameters": parameters})
    assert "not supported when streaming" in assert_validation_error(response)


def test_oversized_body_is_refused(http: httpx.Client) -> None:
    response = http.post("/generate", json={"inputs": "x" * (2 * 1024 * 1024)})
    assert_validation_error(response, status=413)


def test_the_engine_keeps_serving_after_bad_input(http: httpx.Client) -> None:
    for parameters, _ in BAD_PARAMETERS:
        http.post("/generate", json={"inputs": PROMPT, "parameters": parameters})
    assert generate(http, max_new_tokens=3)["generated_text"]


def test_grammar_constrains_the_real_engine(hub: InferenceClient, http: httpx.Client) -> None:
    text = hub.text_generation(
        "num", max_new_tokens=10, grammar={"type": "regex", "value": "[0-9]{3}"},
        return_full_text=False,
    )
    assert len(text) == 3 and text.isdigit()
    response = http.post(
        "/generate",
        json={
            "inputs": "x",
            "parameters": {"max_new_tokens": 5, "grammar": {"type": "regex", "value": "[0-9"}},
        },
    )
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation"
    assert generate(http, max_new_tokens=2)["generated_text"]


# ---- SageMaker /invocations, on a server started with DJL's OPTION_TGI_COMPAT=true ------------


@pytest.fixture(scope="module")
def compat_server(djl_options_server: RunningServer) -> RunningServer:
    return djl_options_server


def test_invocations_with_tgi_compat_serves_text_generation_client(
    compat_server: RunningServer,
) -> None:
    """text_generation.Client posts to its base URL and reads element 0 of TGI's list
    (sagemaker.rs: /invocations with a generate body is POST /)."""
    at_invocations = Client(compat_server.url + "/invocations", timeout=60)
    at_root = Client(compat_server.url, timeout=60)
    out = at_invocations.generate(PROMPT, max_new_tokens=8)
    assert out.generated_text == at_root.generate(PROMPT, max_new_tokens=8).generated_text
    assert out.details.generated_tokens == len(out.details.tokens)
    tokens = list(at_invocations.generate_stream(PROMPT, max_new_tokens=8))
    assert tokens[-1].generated_text == out.generated_text
    assert "".join(t.token.text for t in tokens) == out.generated_text


def test_invocations_with_tgi_compat_serves_the_hub_client_the_full_text(
    compat_server: RunningServer,
) -> None:
    hub = InferenceClient(base_url=compat_server.url + "/invocations", timeout=60)
    with httpx.Client(base_url=compat_server.url, timeout=60) as http:
        plain = generate(http, max_new_tokens=8)["generated_text"]
    assert hub.text_generation(PROMPT, max_new_tokens=8) == PROMPT + plain
    assert "".join(hub.text_generation(PROMPT, max_new_tokens=8, stream=True)) == plain


def test_invocations_with_tgi_compat_answers_tgis_list_and_errors(
    compat_server: RunningServer,
) -> None:
    with httpx.Client(base_url=compat_server.url, timeout=60) as http:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}}
        listed = http.post("/invocations", json=body)
        assert listed.status_code == 200 and listed.headers["x-compute-type"] == "vllm"
        assert listed.json() == http.post("/", json=body).json()
        assert len(listed.json()) == 1
        refused = http.post(
            "/invocations", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 100_000}}
        )
        assert "and 1024 `max_new_tokens`" in assert_validation_error(refused)
        lmi = http.post("/invocations", json={**body, "adapters": "a1"})  # DJL's body stays DJL's
        assert lmi.status_code == 200 and isinstance(lmi.json(), dict)
        with_header = http.post(
            "/invocations", json=body, headers={"X-Amzn-SageMaker-Adapter-Identifier": "a1"}
        )
        by_adapter_id = http.post(
            "/invocations",
            json={"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "adapter_id": "a1"}},
        )
        assert with_header.json() == by_adapter_id.json() != listed.json()
