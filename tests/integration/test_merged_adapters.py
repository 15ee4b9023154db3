"""Adapters composed per request (`merged_adapters`) on the real vLLM engine.

The reference: peft's own `add_weighted_adapter(..., combination_type="cat")` over the demo
adapters a1 and a2 (weights 0.7 and 0.3), saved as an adapter folder and registered by hand
through `/v1/load_lora_adapter`. A request with `merged_adapters` must give exactly the reference's
greedy output, on TGI `/generate` and `/generate_stream` and OpenAI completions and chat, streamed
and not; the composition is built once; bad compositions get a 4xx in each protocol's shape and
leave the engine serving. A server of its own: a1 + a2 has rank 16 (maxLoraRank 16 here).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration.traffic import sse_payloads
from tests.serverproc import (
    DEMO,
    RunningServer,
    base_config,
    ensure_assets,
    merge,
    start_server,
    wait_ready,
)

# the first test's set-up starts a vLLM server and builds the peft reference: minutes on a
# busy machine
pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MERGE = {"ids": ["a1", "a2"], "weights": [0.7, 0.3], "merge_strategy": "linear"}
# as LoRAX's Python client sends it (MergedAdapters: every field, density required)
LORAX_CLIENT_MERGE = {**MERGE, "density": 0.0, "majority_sign_method": None}
PROMPT = "once upon a time the gateway"
TOKENS = 12
CHAT = [{"role": "user", "content": "tell me about the lora cache"}]


def peft_reference(out: Path) -> Path:
    """a1·0.7 + a2·0.3 merged by peft's `cat` combination, saved as an adapter folder."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(DEMO / "model"), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(DEMO / "adapters" / "a1"), adapter_name="a1")
    model.load_adapter(str(DEMO / "adapters" / "a2"), adapter_name="a2")
    model.add_weighted_adapter(["a1", "a2"], [0.7, 0.3], "ref", combination_type="cat")
    model.save_pretrained(str(out), selected_adapters=["ref"])
    return out / "ref"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Path]]:
    """The server starts while peft builds the reference (both take tens of seconds)."""
    folder = tmp_path_factory.mktemp("merged")
    ensure_assets()
    running = start_server(folder, merge(base_config(), {"LoraConfig": {
        "maxLoraRank": 16, "adapterRoots": [str(DEMO), str(folder / "reference")],
        "mergedAdapterDir": str(folder / "cache"),
    }}))
    try:
        reference = peft_reference(folder / "reference")
        wait_ready(running, 480)
        response = httpx.post(f"{running.url}/v1/load_lora_adapter", timeout=60,
                              json={"lora_name": "ref", "lora_path": str(reference)})
        assert response.status_code == 200, response.text
        yield running, folder / "cache"
    finally:
        running.stop()


@pytest.fixture(scope="module")
def http(server: tuple[RunningServer, Path]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0].url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server: tuple[RunningServer, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0].url}/v1", api_key="none", max_retries=0)


def tgi(http: httpx.Client, **parameters: Any) -> str:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS, **parameters}}
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["generated_text"])


def tgi_stream(http: httpx.Client, **parameters: Any) -> str:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS, **parameters}}
    response = http.post("/generate_stream", json=body)
    assert response.status_code == 200, response.text
    events = [json.loads(p) for p in sse_payloads(response.text)]
    assert all("error" not in e for e in events), events
    return str(events[-1]["generated_text"])


def completion(oai: openai.OpenAI, model: str, *, stream: bool, **extra: Any) -> str:
    args: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS,
                            "temperature": 0, "extra_body": extra}
    if not stream:
        return oai.completions.create(**args).choices[0].text
    return "".join(c.choices[0].text for c in oai.completions.create(stream=True, **args))


def chat(oai: openai.OpenAI, model: str, *, stream: bool, **extra: Any) -> str:
    args: dict[str, Any] = {"model": model, "messages": CHAT, "max_tokens": TOKENS,
                            "temperature": 0, "extra_body": extra}
    if not stream:
        return oai.chat.completions.create(**args).choices[0].message.content or ""
    chunks = oai.chat.completions.create(stream=True, **args)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_merged_output_equals_peft_cat_reference(
    server: tuple[RunningServer, Path], http: httpx.Client, oai: openai.OpenAI
) -> None:
    reference = tgi(http, adapter_id="ref")
    assert reference not in {tgi(http), tgi(http, adapter_id="a1"), tgi(http, adapter_id="a2")}
    assert tgi(http, merged_adapters=MERGE) == reference
    assert tgi_stream(http, merged_adapters=LORAX_CLIENT_MERGE, adapter_id=None) == reference
    for stream in (False, True):
        assert completion(oai, "tiny", stream=stream, merged_adapters=MERGE) == (
            completion(oai, "ref", stream=stream)
        )
        assert chat(oai, "tiny", stream=stream, merged_adapters=MERGE) == (
            chat(oai, "ref", stream=stream)
        )
    running, cache = server
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 1  # built once
    assert running.log().count(" composed from ") == 1
    models = [m.id for m in oai.models.list().data]
    assert not any(m.startswith("merged-") for m in models)  # not listed


def test_composed_names_are_not_the_managers_to_take_or_remove(
    server: tuple[RunningServer, Path], http: httpx.Client
) -> None:
    reference = tgi(http, merged_adapters=MERGE)  # composed (or already there)
    key = next(p.name for p in server[1].iterdir() if not p.name.startswith("."))
    composed = f"merged-{key[:16]}"
    removed = http.post("/v1/unload_lora_adapter", json={"lora_name": composed})
    assert removed.status_code == 404, removed.text
    for name in (composed, "merged-0123456789abcdef"):
        taken = http.post("/v1/load_lora_adapter",
                          json={"lora_name": name, "lora_path": str(DEMO / "adapters" / "a1")})
        assert taken.status_code == 400 and "is reserved" in taken.json()["error"]["message"]
    assert tgi(http, merged_adapters=MERGE) == reference


@pytest.mark.parametrize(("merge", "tgi_status", "openai_status", "words"), [
    ({"ids": ["a1", "nope"]}, 422, 404, "`nope` does not exist"),
    ({"ids": ["a1", "a2", "a3"]}, 422, 400, "greater than max_lora_rank 16"),
    ({"ids": ["a1", "a2"], "weights": [1.0]}, 422, 400, "must match number of adapter weights"),
    ({"ids": ["a1"], "weights": ["x"]}, 422, 400, "finite numbers"),
    ({"ids": ["a1", "a2"], "merge_strategy": "ties", "density": 0.5}, 422, 400, "only `linear`"),
    ({"ids": ["a1"], "merge_strategy": "svd"}, 422, 400, "`merge_strategy` must be one of"),
    ({"ids": []}, 422, 400, "at least one adapter ID"),
])
def test_bad_compositions_get_4xx_and_the_engine_keeps_serving(
    http: httpx.Client, oai: openai.OpenAI, merge: dict[str, Any], tgi_status: int,
    openai_status: int, words: str,
) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "merged_adapters": merge}}
    response = http.post("/generate", json=body)
    assert response.status_code == tgi_status, response.text
    assert response.json()["error_type"] == "validation" and words in response.json()["error"]
    with pytest.raises(openai.APIStatusError) as caught:
        completion(oai, "tiny", stream=False, merged_adapters=merge)
    assert caught.value.status_code == openai_status and words in caught.value.message
    assert tgi(http, merged_adapters=MERGE) == tgi(http, adapter_id="ref")  # still serving


def test_merged_adapters_is_for_the_base_model(http: httpx.Client, oai: openai.OpenAI) -> None:
    body = {"inputs": PROMPT,
            "parameters": {"adapter_id": "a1", "merged_adapters": MERGE, "max_new_tokens": 2}}
    response = http.post("/generate", json=body)
    assert response.status_code == 422
    assert "at most one of `adapter_id` or `adapters`" in response.json()["error"]
    with pytest.raises(openai.BadRequestError, match="must be the base model"):
        chat(oai, "a1", stream=False, merged_adapters=MERGE)


def test_a_merge_that_overflows_leaves_other_requests_untouched(
    http: httpx.Client, oai: openai.OpenAI
) -> None:
    """Merge weights are any finite numbers, as LoRAX takes them. One of 1e30 makes its own
    request's activations overflow; the NaN and infinite keys and values it made once stayed in
    the engine's cache blocks, and later requests given those blocks (short prompts, base or
    adapter) answered empty text. Now only finite values are cached: every later answer is the
    one it was before."""
    prompts = ["hi", "what is the", "tell me a story"]

    def answers() -> list[str]:
        return [
            oai.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
            .choices[0].text
            for model in ("tiny", "a1") for prompt in prompts
        ]

    before = answers()
    for weight in (1e30, -3e38):
        poisoned = {"ids": ["a2"], "weights": [weight]}
        for prompt in ("hello there", PROMPT):
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 8,
                                                     "merged_adapters": poisoned}}
            assert http.post("/generate", json=body).status_code == 200
            assert answers() == before
