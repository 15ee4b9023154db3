"""The official `openai` SDK against the gateway process on the real vLLM engine (tiny demo model,
adapters a1-a3): LoRA selection, stream/non-stream parity, usage, n, stop, logprobs, echo, prompt
forms, error classes, runtime LoRA load/unload (as vLLM's own tests drive it) and disconnects."""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.serverproc import CERTS, DEMO, RunningServer

pytestmark = [pytest.mark.engine, pytest.mark.server]

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me about the sky"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
TEST_ADAPTERS = DEMO / "test-adapters"


@pytest.fixture(scope="module")
def client(live_server: RunningServer) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{live_server.url}/v1", api_key="EMPTY", max_retries=0) as sdk:
        yield sdk


@pytest.fixture
async def aclient(live_server: RunningServer) -> Any:
    async with AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="EMPTY", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def http(live_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=60) as raw:
        yield raw


def complete(client: OpenAI, model: str = "tiny", **fields: Any) -> Any:
    return client.completions.create(
        model=model, prompt=fields.pop("prompt", PROMPT), **{**GREEDY, **fields}
    )


def assert_serving(client: OpenAI) -> None:
    """Base and a1 still answer (after a bad request or a bad adapter)."""
    for model in ("tiny", "a1"):
        result = complete(client, model, max_tokens=2)
        assert result.model == model
        assert result.usage is not None and result.usage.completion_tokens == 2


# ---- LoRA selection and determinism -----------------------------------------------------------


def test_greedy_outputs_differ_per_adapter_and_repeat(client: OpenAI) -> None:
    texts = {}
    for model in ("tiny", "a1", "a2"):
        first, again = complete(client, model), complete(client, model)
        assert first.model == again.model == model
        assert first.choices[0].text == again.choices[0].text
        texts[model] = first.choices[0].text
    assert len(set(texts.values())) == 3, texts


def test_chat_response_echoes_adapter_and_has_vllm_fields(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions",
        headers={"X-Request-Id": "oa-conf-1"},
        json={"model": "a2", "messages": MESSAGES, "max_tokens": 3},
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "oa-conf-1"
    body = response.json()
    assert body["id"] == "chatcmpl-oa-conf-1"
    assert body["model"] == "a2"
    assert re.fullmatch(r"vllm-0\.32\.\d+(\.\w+)?-[0-9a-f]{8}", body["system_fingerprint"])
    assert set(body) == {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "prompt_logprobs",
        "prompt_token_ids",
        "kv_transfer_params",
    }
    assert set(body["choices"][0]["message"]) == {
        "role",
        "content",
        "refusal",
        "annotations",
        "audio",
        "function_call",
        "reasoning",
    }


def test_sagemaker_invocations_take_the_adapter_header(http: httpx.Client) -> None:
    headers = {"X-Amzn-SageMaker-Adapter-Identifier": "a3"}
    chat = http.post("/invocations", headers=headers, json={"messages": MESSAGES, "max_tokens": 2})
    assert (chat.status_code, chat.json()["object"], chat.json()["model"]) == (
        200,
        "chat.completion",
        "a3",
    )
    completion = http.post("/invocations", json={"prompt": PROMPT, "max_tokens": 2})
    assert (completion.json()["object"], completion.json()["model"]) == ("text_completion", "tiny")


# ---- stream / non-stream parity, usage ----------------------------------------------------------


def test_chat_stream_joins_to_the_non_streamed_text(client: OpenAI) -> None:
    whole = client.chat.completions.create(model="a1", messages=MESSAGES, **GREEDY)
    chunks = list(
        client.chat.completions.create(model="a1", messages=MESSAGES, stream=True, **GREEDY)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    assert chunks[0].id.startswith("chatcmpl-")
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage anywhere


@pytest.mark.anyio
async def test_completion_stream_joins_to_the_non_streamed_text(aclient: AsyncOpenAI) -> None:
    whole = await aclient.completions.create(model="a2", prompt=PROMPT, **GREEDY)
    stream = await aclient.completions.create(
        model="a2", prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage == whole.usage


def test_usage_counts_match_the_tokenizer(client: OpenAI, http: httpx.Client) -> None:
    result = complete(client, max_tokens=7)
    count = http.post("/tokenize", json={"model": "tiny", "prompt": PROMPT}).json()["count"]
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (count, 7)
    assert result.usage.total_tokens == count + 7
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    chat_count = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert chat.usage is not None
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (chat_count, 12)


def test_chat_default_max_tokens_is_the_models_default_cut_to_the_context(
    client: OpenAI, http: httpx.Client
) -> None:
    """vLLM's rule: the model's generation_config `max_new_tokens` (64 on the demo model),
    cut to the room the prompt leaves in the 512-token context."""
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 64
    assert chat.choices[0].finish_reason == "length"
    long = [{"role": "user", "content": "word " * 160}]  # about 485 tokens
    count = http.post("/tokenize", json={"messages": long}).json()["count"]
    assert 512 - 64 < count < 512
    cut = client.chat.completions.create(
        model="tiny", messages=long, temperature=0, extra_body={"ignore_eos": True}  # type: ignore[list-item]
    )
    assert cut.usage is not None
    assert (cut.usage.prompt_tokens, cut.usage.completion_tokens) == (count, 512 - count)
    default = client.completions.create(
        model="tiny", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert default.usage is not None and default.usage.completion_tokens == 16


def test_continuous_usage_stats_put_usage_on_every_chunk(client: OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="a1",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            **GREEDY,
        )
    )
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts)
    assert counts[-1] == 12
    assert chunks[-1].choices == []


# ---- n, seed, stop, logprobs, echo, prompt forms -------------------------------------------


def test_n_and_seed(client: OpenAI) -> None:
    sampled: dict[str, Any] = {"temperature": 1.0, "max_tokens": 8, "n": 2, "seed": 1234}
    first = client.completions.create(model="tiny", prompt=PROMPT, **sampled)
    again = client.completions.create(model="tiny", prompt=PROMPT, **sampled)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    chat = client.chat.completions.create(model="a1", messages=MESSAGES, n=2, max_tokens=4)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage is not None and chat.usage.completion_tokens <= 8


def test_stop_string_ends_the_choice(client: OpenAI) -> None:
    text = complete(client, max_tokens=16).choices[0].text
    # a plain-ASCII piece from the second half (byte-level tokens may decode to U+FFFD)
    stop = next(
        text[i : i + 2]
        for i in range(len(text) // 2, len(text) - 1)
        if text[i : i + 2].isascii() and text[i : i + 2].strip()
    )
    stopped = complete(client, max_tokens=16, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.model_extra is not None and stopped.model_extra["stop_reason"] == stop
    assert stopped.text == text[: text.index(stop)]


def test_logprobs_for_chat_and_completions(client: OpenAI) -> None:
    chat = client.chat.completions.create(
        model="a1", messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 12
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    # greedy: the chosen token is the most likely one
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) for entry in content)
    completion = complete(client, "a2", logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == 12
    assert logprobs.top_logprobs is not None
    assert all(1 <= len(top) <= 4 for top in logprobs.top_logprobs if top is not None)


def test_echo_prepends_the_prompt(client: OpenAI) -> None:
    plain = complete(client, max_tokens=5).choices[0].text
    echoed = complete(client, max_tokens=5, echo=True).choices[0].text
    assert echoed == PROMPT + plain
    streamed = "".join(
        c.choices[0].text for c in complete(client, max_tokens=5, echo=True, stream=True)
    )
    assert streamed == PROMPT + plain


def test_list_of_prompts_and_token_id_prompts(client: OpenAI, http: httpx.Client) -> None:
    other = "Once upon a time"
    singles = [complete(client, prompt=p, max_tokens=6).choices[0].text for p in (PROMPT, other)]
    batch = complete(client, prompt=[PROMPT, other], max_tokens=6)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == singles
    ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in (PROMPT, other)]
    assert complete(client, prompt=ids[0], max_tokens=6).choices[0].text == singles[0]
    by_ids = complete(client, prompt=ids, max_tokens=6)
    assert [c.text for c in by_ids.choices] == singles


# ---- errors land on the right SDK exception ---------------------------------------------------


def test_unknown_model_is_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-adapter", messages=MESSAGES)
    assert info.value.body == {
        "message": "The model `no-such-adapter` does not exist. Valid aliases: tiny.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt=PROMPT)


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        ("chat", {"messages": []}, "body.messages"),
        ("chat", {"messages": MESSAGES, "temperature": "hot"}, "body.temperature"),
        ("chat", {"messages": MESSAGES, "n": 17}, "n"),
        ("chat", {"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
        (
            "chat",
            {"messages": MESSAGES, "extra_body": {"chat_template_kwargs": {"tokenize": 1}}},
            "chat_template_kwargs.tokenize",
        ),
        ("completion", {"prompt": PROMPT, "logprobs": 50}, "logprobs"),
        ("completion", {"prompt": PROMPT, "max_tokens": 600}, "max_tokens"),
        ("completion", {"prompt": "word " * 600}, None),
        ("completion", {"prompt": [10**6]}, "prompt"),
    ],
)
def test_bad_requests_are_bad_request_errors(
    client: OpenAI, kind: str, fields: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "chat":
            client.chat.completions.create(model="tiny", **fields)
        else:
            client.completions.create(model="tiny", **fields)
    assert isinstance(info.value.body, dict)
    assert info.value.body["code"] == 400
    assert info.value.body["param"] == param


def test_malformed_and_non_json_bodies_are_400(http: httpx.Client, client: OpenAI) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        broken = http.post(
            path, content=b'{"prompt": ', headers={"content-type": "application/json"}
        )
        assert broken.status_code == 400
        assert broken.json()["error"]["type"] == "BadRequestError"
        form = http.post(
            path,
            content=b"prompt=hi",
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert form.status_code == 400
        assert form.json()["error"]["message"] == (
            "Unsupported Media Type: Only 'application/json' is allowed"
        )
    assert_serving(client)


# ---- models and runtime LoRA --------------------------------------------------------------------


def test_models_list_shows_lineage(client: OpenAI, http: httpx.Client) -> None:
    models = client.models.list().data
    assert models[0].id == "tiny"
    assert models[0].model_extra is not None and models[0].model_extra["parent"] is None
    by_id = {m.id: m.model_extra for m in models}
    for adapter in ("a1", "a2", "a3"):
        assert by_id[adapter] is not None and by_id[adapter]["parent"] == "tiny"
    assert client.models.retrieve("a1").model_extra == {"parent": "tiny"}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("ghost")


def load(client: OpenAI, name: str, path: Path | str, **extra: Any) -> str:
    body = {"lora_name": name, "lora_path": str(path), **extra}
    return client.post("load_lora_adapter", cast_to=str, body=body)


def unload(client: OpenAI, name: str) -> str:
    return client.post("unload_lora_adapter", cast_to=str, body={"lora_name": name})


def test_runtime_lora_lifecycle(client: OpenAI) -> None:
    name = "openai-conf-a4"
    assert load(client, name, TEST_ADAPTERS / "a4") == (
        f"Success: LoRA adapter '{name}' added successfully."
    )
    try:
        assert name in [m.id for m in client.models.list().data]
        assert complete(client, name, max_tokens=3).model == name
        with pytest.raises(openai.BadRequestError, match="has already been loaded"):
            load(client, name, TEST_ADAPTERS / "a4")
        assert load(client, name, TEST_ADAPTERS / "a5", load_inplace=True).startswith("Success")
    finally:
        assert unload(client, name) == f"Success: LoRA adapter '{name}' removed successfully."
    assert name not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        complete(client, name)
    with pytest.raises(openai.NotFoundError, match="cannot be found"):
        unload(client, name)
    assert load(client, name, TEST_ADAPTERS / "a4").startswith("Success")  # the name is free
    assert unload(client, name).startswith("Success")


@pytest.mark.parametrize(
    ("adapter", "error", "message"),
    [
        ("big16", openai.BadRequestError, "is greater than max_lora_rank"),
        ("corrupt", openai.BadRequestError, "corrupt"),
        ("pickle_only", openai.BadRequestError, "safetensors"),
        ("noconfig", openai.NotFoundError, "No adapter found"),
        ("not-there", openai.NotFoundError, "No adapter found"),
    ],
)
def test_bad_adapters_are_refused_and_nothing_breaks(
    client: OpenAI, adapter: str, error: type[Exception], message: str
) -> None:
    name = f"openai-bad-{adapter}"
    with pytest.raises(error, match=message):  # type: ignore[call-overload]
        load(client, name, TEST_ADAPTERS / adapter)
    assert name not in [m.id for m in client.models.list().data]
    assert_serving(client)


def test_runtime_lora_routes_are_also_on_the_management_listener(
    live_server: RunningServer, client: OpenAI
) -> None:
    name = "openai-conf-mgmt"
    tls = ssl.create_default_context(cafile=str(CERTS / "ca.pem"))
    tls.load_cert_chain(str(CERTS / "client.pem"), str(CERTS / "client.key"))  # mTLS plane
    with httpx.Client(base_url=live_server.management_url, verify=tls, timeout=60) as management:
        body = {"lora_name": name, "lora_path": str(TEST_ADAPTERS / "a6")}
        loaded = management.post("/v1/load_lora_adapter", json=body)
        assert (loaded.status_code, loaded.text) == (
            200,
            f"Success: LoRA adapter '{name}' added successfully.",
        )
        assert complete(client, name, max_tokens=2).model == name  # served on the data port
        gone = management.post("/v1/unload_lora_adapter", json={"lora_name": name})
        assert gone.status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, name)


def test_lora_route_refusals(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="must be provided"):
        load(client, "", TEST_ADAPTERS / "a4")
    with pytest.raises(openai.BadRequestError, match="conflicts with a served base model"):
        load(client, "tiny", TEST_ADAPTERS / "a4")
    with pytest.raises(openai.BadRequestError, match="outside the allowed adapter roots"):
        load(client, "openai-escape", "/etc")
    assert_serving(client)


# ---- disconnects ---------------------------------------------------------------------------


def scrape(server: RunningServer) -> dict[str, float]:
    text = httpx.get(f"{server.metrics_url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("gateway_requests_inflight", "gateway_generation_tokens_total"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def wait_idle(server: RunningServer, deadline_s: float = 30.0) -> dict[str, float]:
    """Poll (bounded) until no generation is in flight."""
    end = time.monotonic() + deadline_s
    while True:
        values = scrape(server)
        if values.get("gateway_requests_inflight", 0.0) == 0 or time.monotonic() > end:
            return values
        time.sleep(0.05)


def test_client_disconnect_mid_stream_aborts_the_generation(
    live_server: RunningServer, client: OpenAI
) -> None:
    before = wait_idle(live_server)
    body = {
        "model": "a1",
        "messages": MESSAGES,
        "stream": True,
        "max_tokens": 480,
        "ignore_eos": True,
    }
    with (
        httpx.Client(base_url=live_server.url, timeout=60) as raw,
        raw.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        first = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert json.loads(first[0].removeprefix("data: "))["choices"][0]["delta"]["role"]
    after = wait_idle(live_server)
    assert after["gateway_requests_inflight"] == 0
    # an aborted request reports no usage: nowhere near the 480 tokens it asked for
    tokens = after["gateway_generation_tokens_total"] - before["gateway_generation_tokens_total"]
    assert tokens < 100
    assert_serving(client)


def test_client_disconnect_before_a_non_streamed_answer_aborts_it(
    live_server: RunningServer, client: OpenAI
) -> None:
    before = wait_idle(live_server)
    body = {"model": "a2", "prompt": PROMPT, "max_tokens": 490, "ignore_eos": True}
    # the client gives up long before 490 tokens are ready and closes its connection
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=0.3)
    after = wait_idle(live_server)
    assert after["gateway_requests_inflight"] == 0
    tokens = after["gateway_generation_tokens_total"] - before["gateway_generation_tokens_total"]
    assert tokens < 100
    assert_serving(client)


@pytest.mark.anyio
async def test_concurrent_async_streams_on_mixed_adapters(aclient: AsyncOpenAI) -> None:
    async def run(model: str) -> tuple[str, str]:
        stream = await aclient.chat.completions.create(
            model=model, messages=MESSAGES, stream=True, max_tokens=8, temperature=0
        )
        chunks = [chunk async for chunk in stream]
        return chunks[-1].model, "".join(c.choices[0].delta.content or "" for c in chunks)

    results = await asyncio.gather(*(run(m) for m in ("tiny", "a1", "a2", "a3") * 2))
    assert [model for model, _ in results] == ["tiny", "a1", "a2", "a3"] * 2
    assert all(text for _, text in results)


def test_structured_outputs_constrain_the_real_engine(client: OpenAI) -> None:
    choice = client.chat.completions.create(
        model="a1",
        messages=[{"role": "user", "content": "pick"}],
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert choice.choices[0].message.content in ("yes", "no")
    digits = complete(
        client,
        prompt="num",
        max_tokens=10,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )
    assert re.fullmatch(r"[0-9]{3}", digits.choices[0].text)
    colour = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "color"}],
        max_tokens=10,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": {"type": "string", "enum": ["red", "green"]}},
        },
    )
    assert json.loads(colour.choices[0].message.content or "") in ("red", "green")


def test_invalid_structured_output_is_a_400_and_the_engine_serves_on(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="regex"):
        complete(
            client, prompt="x", max_tokens=5, extra_body={"structured_outputs": {"regex": "[0-9"}}
        )
    assert_serving(client)


def test_token_restrictions_that_leave_the_constraint_no_token_are_a_400(
    client: OpenAI, http: httpx.Client
) -> None:
    """vLLM's scheduler ends such a request with an error (its server: a 500): the client's
    restrictions and its constraint have no token in common, so it is the client's 400."""
    regex = {"structured_outputs": {"regex": "[a-z]{3}"}}
    with pytest.raises(openai.BadRequestError, match="constraint and allowed_token_ids left no"):
        complete(client, prompt="hi", max_tokens=6,
                 extra_body={**regex, "allowed_token_ids": [5]})
    triton = http.post("/v2/models/tiny/generate", json={"text_input": "hi", "parameters": {
        "max_tokens": 6, "allowed_token_ids": [5], "structured_outputs": '{"regex": "[a-z]{3}"}'}})
    assert triton.status_code == 400 and "left no token" in triton.json()["error"]
    assert_serving(client)


def test_beam_search_on_the_base_model_and_an_adapter(client: OpenAI) -> None:
    """vLLM's beam search: `n` distinct beams, the same each time, best first (with
    `ignore_eos` every beam has the same length, so best first is by summed logprob)."""
    beams = {"use_beam_search": True, "return_token_ids": True}
    for model in ("tiny", "a1"):
        first = complete(client, model, prompt="The capital of", max_tokens=4, n=3,
                         extra_body=beams)
        again = complete(client, model, prompt="The capital of", max_tokens=4, n=3,
                         extra_body=beams)
        ids = [tuple((c.model_extra or {})["token_ids"]) for c in first.choices]
        assert len(ids) == 3 and len(set(ids)) == 3
        assert ids == [tuple((c.model_extra or {})["token_ids"]) for c in again.choices]
        assert first.usage is not None and first.usage.completion_tokens == sum(map(len, ids))
        ranked = complete(client, model, prompt="The capital of", max_tokens=4, n=3, logprobs=1,
                          extra_body={"use_beam_search": True, "ignore_eos": True})
        sums = [sum(c.logprobs.token_logprobs) for c in ranked.choices]
        assert sums == sorted(sums, reverse=True)
    chat = client.chat.completions.create(
        model="a2", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, n=2,
        extra_body={"use_beam_search": True},
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(c.finish_reason in ("length", "stop") for c in chat.choices)
    with pytest.raises(openai.BadRequestError, match="Streaming is not currently supported"):
        complete(client, prompt="x", max_tokens=2, stream=True, extra_body=beams)
    assert_serving(client)


def test_models_list_shows_paths_like_vllm_when_no_keys_are_configured(client: OpenAI) -> None:
    roots = {m.id: (m.model_extra or {})["root"] for m in client.models.list().data}
    assert roots["tiny"].endswith("build/demo/model")
    assert roots["a1"].endswith("build/demo/adapters/a1")
