"""Adapters as operators run them, on the real engine through real sockets: a folder dropped
into adapterDir serves on its first request (openai, huggingface_hub), a name re-registered with
other weights serves the new ones, files changed in place are served changed, a removed folder
goes away, a malformed one is refused with its reason and the engine keeps serving, and the
state file brings runtime registrations back after a restart.

Greedy outputs identify weights: the demo adapters a1, a2, a3 (and test-adapters a4...) answer
differently from each other and from the base model.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI

from server.core.adapter_state import read_state
from tests.integration.traffic import management_client
from tests.serverproc import DEMO, RunningServer, running_server

pytestmark = [pytest.mark.server, pytest.mark.engine]

ADAPTERS = DEMO / "adapters"
TEST_ADAPTERS = DEMO / "test-adapters"
PROMPT = "Once upon a time"
REFRESH_S = 0.5


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapter-dir")
    shutil.copytree(ADAPTERS / "a1", root / "adapters" / "a1")
    return root


def config_for(folder: Path) -> dict[str, Any]:
    return {
        "LoraConfig": {
            "adapterDir": str(folder / "adapters"),
            "adapterRoots": [str(DEMO), str(folder)],
            "adapterDirRefresh": REFRESH_S,
            "stateFile": str(folder / "state" / "adapters.json"),
        },
    }


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[RunningServer]:
    with running_server(folder / "run1", overrides=config_for(folder)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120)


def greedy(client: OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    return out.choices[0].text


def models(client: OpenAI) -> set[str]:
    return {m.id for m in client.models.list().data}


def wait_for(check: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "the folder rescan did not happen in time"
        time.sleep(0.1)


def drop(folder: Path, source: Path, name: str) -> Path:
    target = folder / "adapters" / name
    shutil.copytree(source, target)
    return target


def test_a_dropped_in_folder_serves_its_first_request_as_the_same_weights_by_hand(
    client: OpenAI, folder: Path
) -> None:
    by_hand = greedy(client, reference(client, ADAPTERS / "a1"))
    assert by_hand != greedy(client, "tiny")
    drop(folder, ADAPTERS / "a1", "dropped-a1")
    assert greedy(client, "dropped-a1") == by_hand
    assert "dropped-a1" in models(client)


def test_the_first_request_may_come_from_huggingface_hub_chat(
    server: RunningServer, client: OpenAI, folder: Path
) -> None:
    drop(folder, ADAPTERS / "a2", "hub-a2")
    hub = InferenceClient(base_url=server.url, timeout=120)
    messages = [{"role": "user", "content": PROMPT}]
    chat = hub.chat_completion(messages, model="hub-a2", max_tokens=6, temperature=0)
    expected = client.chat.completions.create(
        model=reference(client, ADAPTERS / "a2"), messages=messages,  # type: ignore[arg-type]
        max_tokens=6, temperature=0,
    )
    assert chat.model == "hub-a2"
    assert chat.choices[0].message.content == expected.choices[0].message.content


@pytest.mark.parametrize("protocol", ["triton", "tgi", "mindie"])
def test_every_protocol_serves_a_dropped_in_folder_on_its_first_request(
    server: RunningServer, client: OpenAI, folder: Path, protocol: str
) -> None:
    name = f"first-{protocol}"
    drop(folder, ADAPTERS / "a3", name)
    expected = greedy(client, reference(client, ADAPTERS / "a3"))
    with httpx.Client(base_url=server.url, timeout=120) as http:
        if protocol == "triton":
            r = http.post(f"/v2/models/{name}/generate", json={
                "text_input": PROMPT, "exclude_input_in_output": True,
                "parameters": {"max_tokens": 8, "temperature": 0}})
            text = r.json()["text_output"]
        elif protocol == "tgi":
            r = http.post("/generate", json={"inputs": PROMPT, "parameters": {
                "max_new_tokens": 8, "adapter_id": name}})
            text = r.json()["generated_text"]
        else:
            r = http.post("/generate", json={"prompt": PROMPT, "model": name,
                                             "max_tokens": 8, "temperature": 0})
            text = r.json()["text"][0].removeprefix(PROMPT)  # vLLM's /generate echoes it
    assert r.status_code == 200, r.text
    assert text.strip() == expected.strip()  # vLLM's /generate joins prompt and text itself


def test_a_name_found_nowhere_is_still_a_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        greedy(client, "not-in-any-folder")


def test_files_replaced_in_place_are_served_replaced(client: OpenAI, folder: Path) -> None:
    target = drop(folder, ADAPTERS / "a1", "swapped")
    assert greedy(client, "swapped") == greedy(client, reference(client, ADAPTERS / "a1"))
    for item in (ADAPTERS / "a3").iterdir():
        shutil.copyfile(item, target / item.name)
    assert greedy(client, "swapped") == greedy(client, reference(client, ADAPTERS / "a3"))


def reference(client: OpenAI, source: Path) -> str:
    """The same weights registered by hand (vLLM's load_lora_adapter), as `ref-<folder>`."""
    name = f"ref-{source.name}"
    if name not in models(client):
        client.post("load_lora_adapter", cast_to=str,
                    body={"lora_name": name, "lora_path": str(source)})
    return name


def test_a_re_registered_name_serves_its_new_weights(client: OpenAI) -> None:
    def load(path: Path) -> None:
        client.post("load_lora_adapter", cast_to=str, body={"lora_name": "again",
                                                             "lora_path": str(path)})

    load(TEST_ADAPTERS / "a4")
    first = greedy(client, "again")
    client.post("unload_lora_adapter", cast_to=str, body={"lora_name": "again"})
    load(TEST_ADAPTERS / "a5")
    second = greedy(client, "again")
    client.post("unload_lora_adapter", cast_to=str, body={"lora_name": "again"})
    load(TEST_ADAPTERS / "a4")
    assert greedy(client, "again") == first != second
    client.post("unload_lora_adapter", cast_to=str, body={"lora_name": "again"})


def test_a_removed_folder_goes_from_every_list(client: OpenAI, folder: Path) -> None:
    target = drop(folder, ADAPTERS / "a2", "short-lived")
    wait_for(lambda: "short-lived" in models(client))
    greedy(client, "short-lived")
    shutil.rmtree(target)
    wait_for(lambda: "short-lived" not in models(client))
    with pytest.raises(openai.NotFoundError):
        greedy(client, "short-lived")


def test_a_malformed_folder_is_refused_with_its_reason_and_the_engine_serves(
    server: RunningServer, client: OpenAI, folder: Path
) -> None:
    drop(folder, TEST_ADAPTERS / "big16", "too-big")
    with pytest.raises(openai.BadRequestError, match="greater than max_lora_rank"):
        greedy(client, "too-big")
    with management_client(server, timeout=30) as management:
        described = management.get("/models/tiny/adapters/too-big").json()
    assert described["status"] == "failed" and "max_lora_rank" in described["reason"]
    assert greedy(client, "a1")


def test_cold_loads_are_counted_in_metrics(server: RunningServer, client: OpenAI) -> None:
    text = httpx.get(f"{server.metrics_url}/metrics", timeout=30).text
    assert 'gateway_adapter_cold_loads_total{adapter="dropped-a1"}' in text
    assert 'gateway_adapter_load_seconds_count{adapter="dropped-a1"}' in text


def test_runtime_registrations_survive_a_restart(
    server: RunningServer, client: OpenAI, folder: Path
) -> None:
    """Last: it stops the module's server and starts another on the same state file."""
    body = {"name": "kept", "src": str(TEST_ADAPTERS / "a6"), "pin": "true"}
    with management_client(server, timeout=60) as management:
        registered = management.post("/models/tiny/adapters", params=body)
    assert registered.status_code == 200, registered.text
    before = greedy(client, "kept")
    saved = {a.name: a for a in read_state(folder / "state" / "adapters.json")}
    assert saved["kept"].pin is True  # with every other runtime registration (the refs)
    assert "a1" not in saved and "dropped-a1" not in saved  # folders bring back their own
    server.stop()
    with running_server(folder / "run2", overrides=config_for(folder)) as again:
        second = OpenAI(base_url=f"{again.url}/v1", api_key="none", timeout=120)
        assert greedy(second, "kept") == before
        with management_client(again, timeout=30) as management:
            described = management.get("/models/tiny/adapters/kept").json()
        assert described["pin"] is True and described["origin"] == "api"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "is not valid JSON"),
        ("my-host-name\n", "is not an adapter state journal"),  # not ours: never overwritten
    ],
)
def test_a_damaged_or_foreign_state_file_stops_the_start_naming_it(
    folder: Path, content: str, problem: str
) -> None:
    broken = folder / f"broken-{len(content)}"
    broken.mkdir()
    (broken / "state.json").write_text(content)
    config = config_for(folder)
    config["LoraConfig"]["stateFile"] = str(broken / "state.json")
    with pytest.raises(RuntimeError) as caught, running_server(broken, overrides=config):
        pass
    assert f"state.json {problem}" in str(caught.value)
    assert "Fix:" in str(caught.value)
    assert (broken / "state.json").read_text() == content
