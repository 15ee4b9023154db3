"""DJL Serving / SageMaker adapter API and LMI inference against the live server (real vLLM
engine, demo model, adapters a1-a3, workflow `tiny-a2`).

Covers every management route with and without the `/models/{m}` prefix (register, update,
describe, unregister, paginated list) and their DJL errors, SageMaker's `POST /adapters` with a
JSON body, `/invocations` and `/predictions/{m}` with each way of choosing an adapter, multi-adapter
batches, JSON-lines streams, `/ping`, the same adapter through every protocol, every kind of bad
adapter (refused with DJL's 424 while base and adapters keep serving) and per-adapter metrics.
Every adapter this module registers is named `djl-*` and unregistered again.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.traffic import management_client
from tests.serverproc import DEMO, DEMO_WORKFLOW, RunningServer

PROMPT = "the quick brown fox jumps over"
TOKENS = 8
ADAPTERS = DEMO / "adapters"
TEST_ADAPTERS = DEMO / "test-adapters"

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def data(live_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def mgmt(live_server: RunningServer) -> Iterator[httpx.Client]:
    with management_client(live_server, timeout=60) as http:
        yield http


def lmi(data: httpx.Client, path: str = "/invocations", **body: Any) -> httpx.Response:
    body.setdefault("inputs", PROMPT)
    body.setdefault("parameters", {"max_new_tokens": TOKENS})
    return data.post(path, json=body)


def generated(data: httpx.Client, adapter: str = "", **kwargs: Any) -> str:
    response = lmi(data, adapters=adapter, **kwargs)
    assert response.status_code == 200, response.text
    text: str = response.json()["generated_text"]
    return text


@pytest.fixture(scope="module")
def reference(data: httpx.Client) -> dict[str, str]:
    """Greedy output of base and each registered demo adapter, each run alone."""
    return {name: generated(data, name) for name in ("", "a1", "a2", "a3")}


def assert_serving(data: httpx.Client, reference: dict[str, str]) -> None:
    for name in ("", "a1", "a2"):
        assert generated(data, name) == reference[name]


def register(mgmt: httpx.Client, name: str, src: Path | str, **params: Any) -> httpx.Response:
    return mgmt.post("/models/tiny/adapters", params={"name": name, "src": str(src), **params})


def unregister(mgmt: httpx.Client, name: str) -> None:
    mgmt.delete(f"/adapters/{name}")


def djl_error(response: httpx.Response, status: int, java_type: str, words: str) -> None:
    assert response.status_code == status, response.text
    assert response.text.endswith("}\n")
    body = response.json()
    assert (body["code"], body["type"]) == (status, java_type)
    assert words in body["message"], body["message"]


def test_adapters_differ_from_base(reference: dict[str, str]) -> None:
    assert len(set(reference.values())) == 4


# ---- list, describe ------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["/models/tiny", ""])
def test_list_walked_with_limit_1_to_the_end_matches_the_full_list(
    mgmt: httpx.Client, prefix: str
) -> None:
    full = mgmt.get(f"{prefix}/adapters")
    assert full.status_code == 200 and full.text.endswith("}\n")
    assert "nextPageToken" not in full.json()
    names = [item["name"] for item in full.json()["adapters"]]
    assert {"a1", "a2", "a3"} <= set(names)
    walked: list[str] = []
    token: str | None = "0"
    while token is not None:
        page = mgmt.get(f"{prefix}/adapters", params={"limit": 1, "next_page_token": token}).json()
        assert len(page["adapters"]) == 1
        walked.append(page["adapters"][0]["name"])
        token = page.get("nextPageToken")
        assert token is None or token == str(len(walked))
    assert walked == names


def test_list_items_and_describe_have_djl_fields(mgmt: httpx.Client) -> None:
    item = next(a for a in mgmt.get("/adapters").json()["adapters"] if a["name"] == "a1")
    assert item["src"] == str(ADAPTERS / "a1")
    assert (item["preload"], item["pin"]) == (True, False)
    for path in ("/models/tiny/adapters/a1", "/adapters/a1"):
        described = mgmt.get(path)
        assert described.status_code == 200 and described.text.endswith("}\n")
        body = described.json()
        assert {k: body[k] for k in ("name", "src", "preload", "pin")} == {
            "name": "a1", "src": str(ADAPTERS / "a1"), "preload": True, "pin": False}
        assert body["engineLoaded"] is True and body["residency"] in ("cpu_cache", "engine_slot")


# ---- register / update / unregister -----------------------------------------------------------

def test_register_update_describe_unregister_through_the_djl_routes(
    mgmt: httpx.Client, data: httpx.Client
) -> None:
    name = "djl-life"
    created = register(mgmt, name, TEST_ADAPTERS / "a4", preload="false", rank_hint="8")
    assert created.status_code == 200
    assert created.text == '{\n  "status": "Adapter djl-life registered"\n}\n'
    try:
        lazy = mgmt.get(f"/models/tiny/adapters/{name}").json()
        assert (lazy["preload"], lazy["residency"], lazy["engineLoaded"]) == (
            False, "registered", False)
        assert lazy["options"] == {"rank_hint": "8"}
        a4_text = generated(data, name)
        used = mgmt.get(f"/adapters/{name}").json()
        assert used["engineLoaded"] is True and used["requests"] == 1
        pinned = mgmt.post(f"/models/tiny/adapters/{name}/update", params={"pin": "true"})
        assert pinned.json() == {"status": "Adapter djl-life updated"}
        assert mgmt.get(f"/adapters/{name}").json()["pin"] is True
        moved = mgmt.post(f"/adapters/{name}/update", params={
            "src": str(TEST_ADAPTERS / "a5"), "pin": "false"})
        assert moved.status_code == 200
        now = mgmt.get(f"/adapters/{name}").json()
        assert (now["src"], now["pin"]) == (str(TEST_ADAPTERS / "a5"), False)
        assert generated(data, name) != a4_text  # a5's weights now
    finally:
        gone = mgmt.delete(f"/models/tiny/adapters/{name}")
    assert gone.json() == {"status": "Adapter djl-life unregistered"}
    djl_error(mgmt.get(f"/adapters/{name}"), 404, "BadRequestException",
              "The adapter djl-life was not found")
    refused = lmi(data, adapters=name)
    assert refused.status_code == 424
    assert refused.json() == {"error": "Adapter djl-life is not registered", "code": 424}


def test_sagemaker_register_with_json_body_and_delete(
    mgmt: httpx.Client, data: httpx.Client, reference: dict[str, str]
) -> None:
    body = {"name": "djl-sm", "src": str(ADAPTERS / "a3"), "preload": True, "pin": False}
    created = mgmt.post("/adapters", json=body)
    assert (created.status_code, created.text) == (200, "Adapter djl-sm registered")
    try:
        assert generated(data, "djl-sm") == reference["a3"]  # same weights as a3
    finally:
        deleted = mgmt.delete("/adapters/djl-sm")
    assert deleted.status_code == 200
    assert deleted.json()["status"] == "Adapter djl-sm unregistered"


def test_alias_header_names_the_adapter_in_answers(mgmt: httpx.Client) -> None:
    alias = {"X-Amzn-SageMaker-Adapter-Alias": "friendly"}
    created = mgmt.post("/adapters", params={"name": "djl-alias", "src": str(ADAPTERS / "a1")},
                        headers=alias)
    assert created.json() == {"status": "Adapter friendly registered"}
    missing = mgmt.get("/adapters/djl-nope", headers=alias)
    djl_error(missing, 404, "BadRequestException", "The adapter friendly was not found")
    assert mgmt.delete("/adapters/djl-alias", headers=alias).json() == {
        "status": "Adapter friendly unregistered"}


def test_management_errors_have_djl_shapes(mgmt: httpx.Client) -> None:
    a4 = str(TEST_ADAPTERS / "a4")
    djl_error(mgmt.post("/adapters", params={"src": a4}), 400, "BadRequestException",
              "The parameter name is required")
    djl_error(mgmt.post("/adapters", params={"name": "djl-x", "src": ""}), 400,
              "BadRequestException", "The parameter src is required")
    djl_error(mgmt.post("/models/nope/adapters", params={"name": "djl-x", "src": a4}), 404,
              "BadRequestException", "The model nope was not found")
    djl_error(mgmt.get("/models/nope/adapters"), 404, "BadRequestException", "nope")
    djl_error(register(mgmt, "a1", a4), 409, "IllegalArgumentException", "already exists")
    djl_error(mgmt.post("/adapters/djl-nope/update", params={"pin": "true"}), 404,
              "BadRequestException", "The adapter djl-nope was not found")
    djl_error(mgmt.delete("/models/tiny/adapters/djl-nope"), 404, "BadRequestException",
              "djl-nope")
    djl_error(mgmt.put("/adapters"), 405, "MethodNotAllowedException", "not allowed")
    djl_error(mgmt.post("/adapters/a1"), 405, "MethodNotAllowedException", "not allowed")
    # what DJL's Python handler refuses is its 424 (adapter_manager_mixin.py register_adapter)
    djl_error(register(mgmt, "djl-x", a4, preload="false", pin="true"), 424,
              "BadRequestException", "Can not set preload to false and pin to true")
    djl_error(mgmt.post("/adapters/a1/update", params={"src": str(TEST_ADAPTERS / "nope")}), 424,
              "BadRequestException", "not a directory")
    assert mgmt.get("/adapters/a1").json()["src"] == str(ADAPTERS / "a1")  # left unchanged
    djl_error(register(mgmt, "tiny", a4), 400, "BadRequestException", "conflicts with a served")
    djl_error(register(mgmt, "bad name!", a4), 400, "BadRequestException", "Invalid adapter name")
    djl_error(mgmt.get("/adapters", params={"limit": "x"}), 400, "BadRequestException", "limit")
    djl_error(mgmt.post("/adapters", content=b"[1]"), 400, "BadRequestException", "JSON object")


def test_more_pins_than_slots_answers_507_no_free_lora_slots(mgmt: httpx.Client) -> None:
    pins = ["djl-pin1", "djl-pin2"]  # maxLoras 2, maxCpuLoras 4: two pins fit
    try:
        for name, src in zip(pins, ("a6", "a7"), strict=True):
            assert register(mgmt, name, TEST_ADAPTERS / src, pin="true").status_code == 200
        djl_error(register(mgmt, "djl-pin3", TEST_ADAPTERS / "a8", pin="true"), 507,
                  "BadRequestException", "No free lora slots")
        assert mgmt.get("/adapters/djl-pin3").status_code == 404
        djl_error(mgmt.post("/adapters/a1/update", params={"pin": "true"}), 507,
                  "BadRequestException", "No free lora slots")
    finally:
        for name in pins:
            unregister(mgmt, name)


# ---- bad adapters ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def escape_link() -> Iterator[Path]:
    """A symlink inside the allowed root pointing at a valid adapter outside it."""
    outside = Path("/tmp") / "djl-outside-root" / "a1"
    shutil.copytree(ADAPTERS / "a1", outside, dirs_exist_ok=True)
    link = DEMO / "djl-escape-link"
    link.unlink(missing_ok=True)
    link.symlink_to(outside, target_is_directory=True)
    try:
        yield link
    finally:
        link.unlink(missing_ok=True)
        shutil.rmtree(outside.parent, ignore_errors=True)


BAD = {
    "rank too high": (str(TEST_ADAPTERS / "big16"), "greater than max_lora_rank 8"),
    "missing dir": (str(TEST_ADAPTERS / "nope"), "not a directory"),
    "no config": (str(TEST_ADAPTERS / "noconfig"), "adapter_config.json is missing"),
    "corrupt weights": (str(TEST_ADAPTERS / "corrupt"), "corrupt"),
    "pickle-only weights": (str(TEST_ADAPTERS / "pickle_only"), "only safetensors"),
    "outside the allowed root": ("/tmp/djl-outside-root/a1", "outside the allowed adapter roots"),
    "dot dot": (f"{ADAPTERS}/../adapters/a1", "must not contain '..'"),
    "symlink escape": (str(DEMO / "djl-escape-link"), "outside the allowed adapter roots"),
    "proc self": ("/proc/self", "system tree"),
    "proc self cwd": ("/proc/self/cwd/build/demo/adapters/a1", "system tree"),
    "device file": ("/dev/zero", "system tree"),
}


@pytest.mark.parametrize("via", ["djl-query", "sagemaker-json"])
@pytest.mark.parametrize("kind", list(BAD))
def test_bad_adapter_is_refused_with_a_clear_4xx_and_serving_continues(
    mgmt: httpx.Client, data: httpx.Client, reference: dict[str, str], escape_link: Path,
    kind: str, via: str,
) -> None:
    src, words = BAD[kind]
    if via == "djl-query":
        response = register(mgmt, "djl-bad", src)
    else:
        response = mgmt.post("/adapters", json={"name": "djl-bad", "src": src})
    djl_error(response, 424, "BadRequestException", words)  # DJL's handler failure
    assert mgmt.get("/adapters/djl-bad").status_code == 404
    assert_serving(data, reference)


# ---- inference -----------------------------------------------------------------------------------

def test_adapter_chosen_by_body_query_header_and_custom_attributes(
    data: httpx.Client, reference: dict[str, str]
) -> None:
    assert generated(data, "a1") == reference["a1"]
    by_query = data.post("/invocations?adapter=a2", json={
        "inputs": PROMPT, "adapters": "a1", "parameters": {"max_new_tokens": TOKENS}})
    assert by_query.json()["generated_text"] == reference["a2"]
    headers = {"X-Amzn-SageMaker-Custom-Attributes": "x=1;adapter=a3"}
    by_attributes = data.post("/invocations?adapter=a2", headers=headers, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS}})
    assert by_attributes.json()["generated_text"] == reference["a3"]
    headers["X-Amzn-SageMaker-Adapter-Identifier"] = "a1"
    by_header = data.post("/invocations?adapter=a2", headers=headers, json={
        "inputs": PROMPT, "adapters": "a3", "parameters": {"max_new_tokens": TOKENS}})
    assert by_header.json()["generated_text"] == reference["a1"]
    assert generated(data, "") == reference[""]


def test_list_of_inputs_with_different_adapters_runs_as_one_batch(
    data: httpx.Client, reference: dict[str, str]
) -> None:
    names = ["a3", "", "a1", "a2", "a1"]
    response = lmi(data, "/predictions/tiny", inputs=[PROMPT] * 5, adapters=names)
    assert response.status_code == 200
    assert [o["generated_text"] for o in response.json()] == [reference[n] for n in names]


def test_a_batch_of_more_adapters_than_the_engine_holds_is_refused_at_once(
    data: httpx.Client, mgmt: httpx.Client, reference: dict[str, str]
) -> None:
    names = ["a1", "a2", "a3", "djl-w4", "djl-w5"]  # the engine holds 4 (maxCpuLoras)
    for name, src in (("djl-w4", "a4"), ("djl-w5", "a5")):
        assert register(mgmt, name, TEST_ADAPTERS / src).status_code == 200
    try:
        wide = lmi(data, inputs=[PROMPT] * 5, adapters=names)
        assert wide.status_code == 424, wide.text
        assert "5 distinct adapters" in wide.json()["error"]
        assert lmi(data, inputs=[PROMPT] * 4, adapters=names[1:]).status_code == 200
    finally:
        for name in names[3:]:
            unregister(mgmt, name)
    assert_serving(data, reference)


def test_details_and_full_text(data: httpx.Client, reference: dict[str, str]) -> None:
    response = lmi(data, adapters="a1", parameters={
        "max_new_tokens": TOKENS, "details": True, "return_full_text": True})
    body = response.json()
    assert body["generated_text"] == PROMPT + reference["a1"]
    details = body["details"]  # LMI's async schema, its default (tests/conformance/test_djl_http)
    assert details["generated_tokens"] == len(details["tokens"])
    assert details["finish_reason"] in ("length", "stop")
    assert all(isinstance(t["logprob"], float) for t in details["tokens"])


def test_stream_is_json_lines_ending_with_generated_text(
    data: httpx.Client, reference: dict[str, str]
) -> None:
    body = {"inputs": PROMPT, "adapters": "a2", "stream": True,
            "parameters": {"max_new_tokens": TOKENS, "details": True}}
    with data.stream("POST", "/predictions/tiny", json=body) as response:
        assert response.headers["content-type"].startswith("application/jsonlines")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert "".join(line["token"]["text"] for line in lines) == reference["a2"]
    assert lines[-1]["generated_text"] == reference["a2"]
    assert lines[-1]["details"]["generated_tokens"] == len(lines)
    assert all(line["generated_text"] is None for line in lines[:-1])


def test_workflow_serves_base_plus_its_adapter(
    data: httpx.Client, reference: dict[str, str]
) -> None:
    via_path = lmi(data, f"/predictions/{DEMO_WORKFLOW}")
    assert via_path.json()["generated_text"] == reference["a2"]
    via_query = lmi(data, f"/invocations?model_name={DEMO_WORKFLOW}")
    assert via_query.json()["generated_text"] == reference["a2"]


def test_invocation_errors_and_serving_continues(
    data: httpx.Client, reference: dict[str, str]
) -> None:
    unknown = lmi(data, adapters="zz")
    assert (unknown.status_code, unknown.json()) == (
        424, {"error": "Adapter zz is not registered", "code": 424})
    mismatch = lmi(data, inputs=["a", "b"], adapters=["a1"])
    assert mismatch.status_code == 424 and "Number of adapters" in mismatch.json()["error"]
    missing = lmi(data, "/predictions/nope")
    assert missing.status_code == 404
    assert missing.json() == {"code": 404, "type": "ModelNotFoundException",
                              "message": "Model or workflow not found: nope"}
    assert lmi(data, "/invocations?model_name=nope").status_code == 404
    for bad in (b"{not json", b'{"inputs": 5}', b'{"inputs": "x", "parameters": {"top_p": 2}}',
                b'{"inputs": "x", "stream": true, "parameters": {"n": 2}}'):
        refused = data.post("/predictions/tiny", content=bad)
        assert refused.status_code == 424 and refused.json()["code"] == 424
    huge = data.post("/predictions/tiny", content=b'{"inputs": "' + b"x" * 1_100_000 + b'"}')
    assert huge.status_code == 413
    assert_serving(data, reference)


def test_ping(data: httpx.Client) -> None:
    for method in ("GET", "POST"):
        response = data.request(method, "/ping")
        assert response.status_code == 200
        assert response.json()["tiny"] == {"status": "Healthy"}
        assert response.json()[DEMO_WORKFLOW] == {"status": "Healthy"}


# ---- every protocol sees the same registry ------------------------------------------------------

def same_through_every_protocol(data: httpx.Client, adapter: str, workflow: str) -> dict[str, str]:
    openai = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    texts = {
        "djl body": generated(data, adapter),
        "djl query": lmi(data, f"/invocations?adapter={adapter}").json()["generated_text"],
        "sagemaker header": data.post(
            "/invocations", headers={"X-Amzn-SageMaker-Adapter-Identifier": adapter},
            json={"inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS}},
        ).json()["generated_text"],
        "djl workflow": lmi(data, f"/predictions/{workflow}").json()["generated_text"],
        "openai": data.post("/v1/completions", json={**openai, "model": adapter}).json()[
            "choices"][0]["text"],
        "openai workflow": data.post("/v1/completions", json={**openai, "model": workflow}).json()[
            "choices"][0]["text"],
        "tgi": data.post("/generate", json={"inputs": PROMPT, "parameters": {
            "adapter_id": adapter, "max_new_tokens": TOKENS}}).json()["generated_text"],
        "triton": data.post(f"/v2/models/{adapter}/generate", json={
            "text_input": PROMPT, "max_tokens": TOKENS, "temperature": 0,
            "exclude_input_in_output": True}).json()["text_output"],
        "mindie vllm /generate": data.post("/generate", json={
            **openai, "model": adapter}).json()["text"][0].removeprefix(PROMPT + " "),
    }
    return texts


def test_same_adapter_through_every_protocol_gives_the_same_greedy_output(
    data: httpx.Client, reference: dict[str, str]
) -> None:
    texts = same_through_every_protocol(data, "a2", DEMO_WORKFLOW)
    assert texts == dict.fromkeys(texts, reference["a2"])


def test_registered_adapter_appears_in_every_list_and_leaves_them_all(
    mgmt: httpx.Client, data: httpx.Client
) -> None:
    name = "djl-everywhere"
    assert register(mgmt, name, TEST_ADAPTERS / "a9").status_code == 200
    try:
        assert name in [m["id"] for m in data.get("/v1/models").json()["data"]]
        assert name in [a["name"] for a in mgmt.get("/adapters").json()["adapters"]]
        assert data.get(f"/v2/models/{name}/ready").status_code == 200
    finally:
        unregister(mgmt, name)
    assert name not in [m["id"] for m in data.get("/v1/models").json()["data"]]
    assert name not in [a["name"] for a in mgmt.get("/adapters").json()["adapters"]]
    assert data.get(f"/v2/models/{name}/ready").status_code != 200


def test_unregister_frees_the_engine_slot(mgmt: httpx.Client, data: httpx.Client) -> None:
    name, src = "djl-free", TEST_ADAPTERS / "a10"
    assert register(mgmt, name, src).status_code == 200
    loaded = mgmt.get(f"/adapters/{name}").json()
    assert loaded["engineLoaded"] is True
    assert mgmt.delete(f"/adapters/{name}").status_code == 200
    # The same name and source get the same LoRA id back: the engine must no longer hold it.
    assert register(mgmt, name, src, preload="false").status_code == 200
    try:
        again = mgmt.get(f"/adapters/{name}").json()
        assert again["loraId"] == loaded["loraId"]
        assert again["engineLoaded"] is False
    finally:
        unregister(mgmt, name)


def test_per_adapter_metrics_name_registered_adapters_only(
    live_server: RunningServer, data: httpx.Client
) -> None:
    generated(data, "a3")
    lmi(data, adapters="djl-never-registered")
    text = httpx.get(f"{live_server.metrics_url}/metrics", timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
        if s.name.startswith("gateway_adapter_")
    }
    assert samples[("gateway_adapter_requests_total", (("adapter", "a3"),))] >= 1
    assert samples[("gateway_adapter_generation_tokens_total", (("adapter", "a3"),))] >= 1
    assert samples[("gateway_adapter_loads_total", (("adapter", "a3"),))] >= 1
    residency = [k for k, v in samples.items()
                 if k[0] == "gateway_adapter_residency" and dict(k[1])["adapter"] == "a3" and v]
    assert len(residency) == 1
    assert "djl-never-registered" not in text
