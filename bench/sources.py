"""Scenario C's remote-source windows: the first request of an adapter fetched from an S3
server (moto's standalone server on loopback), the same adapter again after it was unregistered
(in the disk cache: a listing, no download), and again while it is loaded (resident)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import boto3
import httpx

from bench.load import Workload
from bench.record import RESULTS, Run
from bench.servers import EngineSettings, Server, free_port, start_gateway

BUCKET = "bench"
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
          "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_server(log: Path) -> Iterator[str]:
    """moto's S3-compatible server on a free loopback port; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(url + "/moto-api/", timeout=2)
                break
            if time.monotonic() > deadline:
                raise RuntimeError("moto's server did not start")
            time.sleep(0.2)
        yield url
    finally:
        process.kill()
        process.wait(10)


def upload(url: str, names: list[str], folder: Path) -> None:
    s3 = boto3.session.Session(
        aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
        region_name=S3_ENV["AWS_DEFAULT_REGION"],
    ).client("s3", endpoint_url=url)
    s3.create_bucket(Bucket=BUCKET)
    for name in names:
        for file in sorted((folder / name).iterdir()):
            s3.upload_file(str(file), BUCKET, f"adapters/{name}/{file.name}")


def source_windows(
    run: Run, engine: EngineSettings, prompts: tuple[str, ...], count: int,
    copies: list[str], folder: Path,
) -> None:
    """`copies`: names of distinct adapters in `folder`, uploaded to the S3 server."""
    cache = RESULTS / "adapter-cache-c"
    shutil.rmtree(cache, ignore_errors=True)
    with moto_server(run.logs / "C-moto.log") as url:
        upload(url, copies, folder)
        overrides = {"LoraConfig": {"adapterSources": [f"s3://{BUCKET}/adapters/"],
                                    "adapterCacheDir": str(cache), "maxLoraRank": 16,
                                    "mergedAdapterDir": str(cache / "merged")}}
        env = {**engine.env(), **S3_ENV, "AWS_ENDPOINT_URL_S3": url}
        server = start_gateway("C-sources", run.logs, engine_settings=engine,
                               overrides=overrides, env=env)
        try:
            names = tuple(copies[:count])
            run.window("C", "gateway", server, single(prompts, names), "s3-first-request")
            unregister(server, names)
            run.window("C", "gateway", server, single(prompts, names), "s3-cached")
            run.window("C", "gateway", server, single(prompts, names[-1:] * (count + 4)),
                       "s3-resident")
            composed_windows(run, server, prompts, count)
            run.session(server, "C", "gateway-sources")
        finally:
            server.stop()


def composed_windows(run: Run, server: Server, prompts: tuple[str, ...], count: int) -> None:
    """`count` compositions of the demo adapters a1 and a2 (rank 8 each), each with its own
    weights: its first request (composed, checked, registered, loaded), then its second."""
    for index in range(count):
        merged = {"ids": ["a1", "a2"], "weights": [0.5 + index / 1000, 0.5],
                  "merge_strategy": "linear"}
        workload = replace(single(prompts, ("tiny",)), extra_body=(("merged_adapters", merged),))
        run.window("C", "gateway", server, workload, "merged-first-request", rep=index)
        run.window("C", "gateway", server, workload, "merged-second-request", rep=index)


def unregister(server: Server, names: tuple[str, ...]) -> None:
    with httpx.Client(base_url=server.management_url or server.url, timeout=60) as client:
        for name in names:
            client.delete(f"/adapters/{name}").raise_for_status()


def single(prompts: tuple[str, ...], models: tuple[str, ...]) -> Workload:
    return Workload(protocol="openai-completions", stream=True, max_tokens=16, prompts=prompts,
                    models=models, concurrency=1, requests=len(models), prompt_len=32)

