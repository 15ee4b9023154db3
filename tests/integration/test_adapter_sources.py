"""Adapters from where fleets keep them, on the real engine: an S3-compatible server (moto's
standalone server), an HTTPS file server with a test CA, a Hugging Face cache, and local
folders; every registration API, on-demand resolution through `adapterSources`, and each
failure (missing, refused, hanging, corrupt, oversized, unsafe, pinned digest mismatch, the S3
server stopped mid-download) answered clearly with nothing registered and the engine serving;
and a cache smaller than the adapters in use: concurrent first uses all served, no download
while idle.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.sources_kit import (
    S3_ENV,
    FileServer,
    MotoServer,
    Proxy,
    evil_tar,
    hub_cache,
    sources_running,
    tar_gz,
    zip_of,
)
from tests.integration.traffic import management_client
from tests.serverproc import DEMO, RunningServer, running_server

pytestmark = pytest.mark.engine

A1, A2 = DEMO / "adapters" / "a1", DEMO / "adapters" / "a2"
PROMPT = "the quick brown fox jumps over"
# ~210 KB: a1 is 35 KB, a2 140 KB, the oversized archive 4 MiB; the adapters the module
# registers (and the 4 the engine holds, kept) take more than that, so the cache evicts
BUDGET_GIB = 0.0002
TIMEOUT_S = 6


class Sources:
    def __init__(
        self, moto: MotoServer, proxy: Proxy, files: FileServer, server: RunningServer,
        cache: Path,
    ) -> None:
        self.moto, self.proxy, self.files, self.server = moto, proxy, files, server
        self.cache = cache


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sources]:
    folder = tmp_path_factory.mktemp("sources")
    www = folder / "www"
    www.mkdir()
    tar_gz(A1, www / "a1.tar.gz", top="a1")
    zip_of(A1, www / "a1.zip")
    (www / "corrupt.tar.gz").write_bytes(b"\x1f\x8b\x08 this is not gzip" * 50)
    evil_tar(www / "escape.tar.gz", "../adapter_config.json")
    evil_tar(www / "absolute.tar.gz", "/tmp/adapter_config.json")
    evil_tar(www / "link.tar.gz", "adapter_model.safetensors", link=True)
    big = folder / "big"
    shutil.copytree(A1, big)
    (big / "padding.bin").write_bytes(bytes(4 << 20))
    tar_gz(big, www / "big.tar.gz")
    hub_cache(folder / "hf", "my-org/tiny-a2", A2)
    with sources_running(folder) as (moto, proxy, files, ca_file):
        for name, adapter in (("a1", A1), ("od-a2", A2), ("cfg-a1", A1)):
            moto.upload("adapters", f"team1/{name}", adapter)
        overrides = {"LoraConfig": {
            "adapterSources": ["s3://adapters/team1/"],
            "adapterCacheDir": str(folder / "cache"),
            "adapterCacheGiB": BUDGET_GIB,
            "adapterSourceTimeout": TIMEOUT_S,
            "adapterSourceCaFile": str(ca_file),
            "adapterDirRefresh": 1,  # the rescan that fetched evicted copies again, kept busy
            "adapters": [{"name": "cfg-s3", "path": "s3://adapters/team1/cfg-a1"}],
        }}
        environ = {**S3_ENV, "AWS_ENDPOINT_URL_S3": proxy.url, "HF_HOME": str(folder / "hf")}
        with running_server(folder / "server", overrides=overrides, environ=environ,
                            ready_timeout=600) as server:
            yield Sources(moto, proxy, files, server, folder / "cache")


@pytest.fixture(scope="module")
def data(sources: Sources) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sources.server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def mgmt(sources: Sources) -> Iterator[httpx.Client]:
    with management_client(sources.server, timeout=120) as client:
        yield client


def greedy(data: httpx.Client, model: str, *, stream: bool = False) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    answer = data.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    text: str = answer.json()["choices"][0]["text"]
    return text


@pytest.fixture(scope="module")
def reference(data: httpx.Client) -> dict[str, str]:
    return {name: greedy(data, name) for name in ("a1", "a2")}


def djl_register(mgmt: httpx.Client, name: str, src: str) -> httpx.Response:
    return mgmt.post("/models/tiny/adapters", params={"name": name, "src": src})


def assert_not_registered(mgmt: httpx.Client, data: httpx.Client, name: str) -> None:
    assert mgmt.get(f"/adapters/{name}").status_code == 404
    assert data.post("/v1/completions", json={"model": name, "prompt": "x"}).status_code == 404


def assert_refused(answer: httpx.Response, words: str) -> None:
    assert answer.status_code == 424, answer.text
    body = answer.json()
    assert body["code"] == 424 and body["type"] == "BadRequestException"
    assert words in body["message"], body["message"]


# ---- every registration API, from each source ----------------------------------------------------
def test_config_adapter_from_s3_serves_its_weights(
    data: httpx.Client, reference: dict[str, str]
) -> None:
    assert greedy(data, "cfg-s3") == reference["a1"]


def test_djl_registration_from_s3(
    mgmt: httpx.Client, data: httpx.Client, reference: dict[str, str]
) -> None:
    answer = djl_register(mgmt, "s3-a1", "s3://adapters/team1/a1")
    assert answer.status_code == 200, answer.text
    assert greedy(data, "s3-a1") == reference["a1"]
    assert mgmt.get("/adapters/s3-a1").json()["src"] == "s3://adapters/team1/a1"


def test_sagemaker_registration_from_a_pinned_https_archive(
    sources: Sources, mgmt: httpx.Client, data: httpx.Client, reference: dict[str, str]
) -> None:
    digest = hashlib.sha256((sources.files.root / "a1.tar.gz").read_bytes()).hexdigest()
    src = sources.files.url("a1.tar.gz") + f"#sha256={digest}"
    answer = mgmt.post("/adapters", json={"name": "https-a1", "src": src})
    assert answer.status_code == 200, answer.text
    assert greedy(data, "https-a1") == reference["a1"]


def test_vllm_registration_from_a_zip_and_from_the_hub(
    sources: Sources, mgmt: httpx.Client, data: httpx.Client, reference: dict[str, str]
) -> None:
    for name, path in (("zip-a1", sources.files.url("a1.zip")),
                       ("hf-a2", "hf://my-org/tiny-a2")):
        answer = mgmt.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        assert answer.status_code == 200, answer.text
    assert greedy(data, "zip-a1") == reference["a1"]
    assert greedy(data, "hf-a2") == reference["a2"]


def test_local_paths_still_register(
    mgmt: httpx.Client, data: httpx.Client, reference: dict[str, str]
) -> None:
    assert djl_register(mgmt, "local-a2", str(A2)).status_code == 200
    assert greedy(data, "local-a2") == reference["a2"]


# ---- on demand ---------------------------------------------------------------------------------
def test_eight_first_requests_download_each_object_once(
    sources: Sources, data: httpx.Client, reference: dict[str, str]
) -> None:
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda _: greedy(data, "od-a2"), range(8)))
    assert texts == [reference["a2"]] * 8
    assert greedy(data, "od-a2") == reference["a2"]
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        assert sources.moto.gets(f"team1/od-a2/{file}") == 1


def test_a_name_found_in_no_source_is_the_protocols_404(data: httpx.Client) -> None:
    openai = data.post("/v1/completions", json={"model": "nowhere", "prompt": "x"})
    assert openai.status_code == 404
    assert openai.json()["error"]["code"] == 404 or openai.json()["error"]["type"]
    tgi = data.post("/generate", json={"inputs": "x", "parameters": {"adapter_id": "nowhere"}})
    assert 400 <= tgi.status_code < 500


def test_tokenize_looks_a_name_up_in_the_sources_as_vllm_does(
    sources: Sources, data: httpx.Client
) -> None:
    """vLLM's `/tokenize` resolves an unknown name (`_check_model`): 404 where no source holds
    it, the adapter registered where one does."""
    for path, body in (
        ("/tokenize", {"prompt": PROMPT}),
        ("/detokenize", {"tokens": [1, 2]}),
        ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        missing = data.post(path, json={**body, "model": "nowhere"})
        assert missing.status_code == 404, (path, missing.text)
        assert "nowhere" in missing.text
    sources.moto.upload("adapters", "team1/tok-a1", A1)
    base = data.post("/tokenize", json={"prompt": PROMPT}).json()
    found = data.post("/tokenize", json={"model": "tok-a1", "prompt": PROMPT})
    assert found.status_code == 200, found.text
    assert found.json()["tokens"] == base["tokens"]
    listed = data.get("/v1/models").json()["data"]
    assert "tok-a1" in [m["id"] for m in listed]


# ---- failures ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "path", "words"),
    [
        ("bad-missing", "s3://adapters/team1/missing", "No adapter found"),
        ("bad-https404", "missing.tar.gz", "No adapter found"),
        ("bad-forbidden", "forbidden/a1.tar.gz", "HTTP 403"),
        ("bad-corrupt", "corrupt.tar.gz", "corrupt"),
        ("bad-big", "big.tar.gz", "more than"),
        ("bad-escape", "escape.tar.gz", "unsafe path"),
        ("bad-absolute", "absolute.tar.gz", "unsafe path"),
        ("bad-link", "link.tar.gz", "link"),
        ("bad-sha", "a1.tar.gz#sha256=" + "0" * 64, "not the pinned"),
        ("bad-hang", "hang/a1.tar.gz", f"within {TIMEOUT_S} s"),
    ],
)
def test_bad_sources_are_refused_and_nothing_is_registered(
    sources: Sources, mgmt: httpx.Client, data: httpx.Client, reference: dict[str, str],
    name: str, path: str, words: str,
) -> None:
    src = path if "://" in path else sources.files.url(path)
    assert_refused(djl_register(mgmt, name, src), words)
    assert_not_registered(mgmt, data, name)
    assert greedy(data, "a1") == reference["a1"]


def test_tls_is_verified(sources: Sources, mgmt: httpx.Client) -> None:
    src = f"https://localhost:{sources.files.port}/a1.tar.gz"  # the certificate names 127.0.0.1
    assert_refused(djl_register(mgmt, "bad-tls", src), "TLS verification")


def test_vllm_route_answers_404_for_a_missing_object(mgmt: httpx.Client) -> None:
    answer = mgmt.post("/v1/load_lora_adapter",
                       json={"lora_name": "bad-vllm", "lora_path": "s3://adapters/team1/none"})
    assert answer.status_code == 404, answer.text


def test_s3_stopped_mid_download_registers_nothing_and_the_next_try_fetches_it_whole(
    sources: Sources, mgmt: httpx.Client, data: httpx.Client, reference: dict[str, str]
) -> None:
    moto, proxy = sources.moto, sources.proxy
    moto.upload("adapters", "team1/slow-a1", A1)
    proxy.rate = 4096.0  # ~7 s for the 30 KB weights
    outcome: dict[str, Any] = {}
    registering = threading.Thread(
        target=lambda: outcome.update(answer=djl_register(mgmt, "slow-a1",
                                                          "s3://adapters/team1/slow-a1")))
    registering.start()
    try:
        wait_for(lambda: moto.gets("team1/slow-a1/adapter_model.safetensors") == 1)
        time.sleep(0.5)  # part of the object is through
        moto.stop()
        proxy.cut()
        registering.join(60)
    finally:
        proxy.rate = None
        if moto.process is not None and moto.process.poll() is not None:
            moto.start()
    assert_refused(outcome["answer"], f"within {TIMEOUT_S} s")  # retried, then given up
    assert_not_registered(mgmt, data, "slow-a1")
    moto.upload("adapters", "team1/slow-a1", A1)  # the restarted server starts empty
    answer = djl_register(mgmt, "slow-a1", "s3://adapters/team1/slow-a1")
    assert answer.status_code == 200, answer.text
    assert moto.gets("team1/slow-a1/adapter_model.safetensors") == 1
    assert greedy(data, "slow-a1") == reference["a1"]


# ---- a cache smaller than the adapters in use ---------------------------------------------
def a1_copies(sources: Sources, folder: Path, names: list[str]) -> None:
    """a1's weights under each name, each with its own contents (its config names it)."""
    for name in names:
        copy = folder / name
        shutil.copytree(A1, copy)
        config = json.loads((copy / "adapter_config.json").read_text())
        config["revision"] = name
        (copy / "adapter_config.json").write_text(json.dumps(config))
        sources.moto.upload("adapters", f"team1/{name}", copy)


def test_concurrent_first_uses_with_a_full_cache_are_all_served(
    sources: Sources, data: httpx.Client, reference: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """12 new names at once, 3 requests each, three rounds, with a cache that holds ~6 of them:
    a folder fetched for one request was evicted by another's commit before the engine read it
    (the engine's add_lora: "No adapter found", or a 404 "does not exist")."""
    folder = tmp_path_factory.mktemp("copies")
    failed, texts = [], set()
    for round_ in range(3):
        names = [f"full-{round_}-{index}" for index in range(12)]
        a1_copies(sources, folder, names)
        with ThreadPoolExecutor(36) as pool:
            answers = list(pool.map(
                lambda name: data.post("/v1/completions", json={
                    "model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                }), [name for name in names for _ in range(3)],
            ))
        failed += [(a.status_code, a.text) for a in answers if a.status_code != 200]
        texts |= {a.json()["choices"][0]["text"] for a in answers if a.status_code == 200}
    assert failed == []
    assert texts == {reference["a1"]}


def test_an_idle_server_downloads_nothing_however_much_was_evicted(
    sources: Sources, data: httpx.Client
) -> None:
    """The adapterDir rescan (every second here) used to see an evicted copy as a change and
    download it again, its commit evicting another: an endless loop of GETs and LISTs."""
    registered = [m["id"] for m in data.get("/v1/models").json()["data"]]
    assert len([n for n in registered if n.startswith("full-")]) == 36
    assert sum(1 for _ in sources.cache.glob("[0-9a-f]" * 64)) < 36  # copies were evicted
    before = sources.moto.reads()
    time.sleep(3.5)  # three rescans
    assert sources.moto.reads() == before


def test_source_metrics(sources: Sources, data: httpx.Client) -> None:
    metrics_url = sources.server.metrics_url + "/metrics"
    text = httpx.get(metrics_url, timeout=30).text
    fetches = {
        (s.labels["scheme"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "gateway_adapter_source_fetches"
        for s in family.samples if s.name.endswith("_total")
    }
    assert fetches[("s3", "downloaded")] >= 3
    assert fetches[("https", "invalid")] >= 5
    assert fetches[("s3", "failed")] >= 1
    assert fetches[("s3", "missing")] >= 1
    assert "gateway_adapter_source_fetch_seconds_bucket" in text


def wait_for(condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
