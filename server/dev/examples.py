"""Print ready-to-paste client examples for a config (used by `make serve`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from server.runtime.tls import tls_files
from server.settings import Settings, load_settings, resolve_path


def curl_prefix(settings: Settings, listener: str) -> tuple[str, str]:
    """The curl TLS flags and the scheme for one listener."""
    files = tls_files(settings, listener)
    if files is None:
        return "curl -s", "http"
    certs = Path(files.cert).parent
    client = resolve_path(settings, str(certs / "client.pem"))
    key = resolve_path(settings, str(certs / "client.key"))
    return f"curl -s --cacert {files.ca_files[0]} --cert {client} --key {key}", "https"


def examples(settings: Settings) -> str:
    server = settings.server
    model = settings.model.name
    curl, scheme = curl_prefix(settings, "data")
    mcurl, mscheme = curl_prefix(settings, "management")
    data = f"{scheme}://localhost:{server.data.port}"
    mgmt = f"{mscheme}://localhost:{server.management.port}"
    files = tls_files(settings, "data")
    tls_client = (
        "import httpx, ssl\n"
        f"ctx = ssl.create_default_context(cafile={files.ca_files[0]!r})\n"
        f"ctx.load_cert_chain({str(Path(files.cert).parent / 'client.pem')!r}, "
        f"{str(Path(files.cert).parent / 'client.key')!r})\n"
        "http_client = httpx.Client(verify=ctx)\n"
        if files
        else "http_client = None\n"
    )
    indented = tls_client.replace("\n", "\n  ")
    return f"""
llm-gateway examples (model {model!r}; adapters a1, a2, a3 on the demo model)

OpenAI chat:
  {curl} {data}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "a1", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 16}}'
TGI:
  {curl} {data}/generate -H 'Content-Type: application/json' \\
    -d '{{"inputs": "Hello", "parameters": {{"max_new_tokens": 16, "adapter_id": "a2"}}}}'
Triton generate:
  {curl} {data}/v2/models/{model}/generate \\
    -d '{{"text_input": "Hello", "parameters": {{"max_tokens": 16}}}}'
Adapters (DJL management API):
  {mcurl} {mgmt}/models/{model}/adapters
Health and metrics:
  {mcurl} {mgmt}/v1/status

openai SDK:
  from openai import OpenAI
  {indented}client = OpenAI(base_url="{data}/v1", api_key="EMPTY", http_client=http_client)
  print(client.chat.completions.create(model="a1", max_tokens=16,
        messages=[{{"role": "user", "content": "Hello"}}]).choices[0].message.content)
{grpc_example(settings)}"""


def grpc_example(settings: Settings) -> str:
    """tritonclient.grpc against the gRPC listener, when there is one."""
    listener = settings.server.grpc
    if listener.port is None:
        return ""
    files = tls_files(settings, "grpc")
    tls = ""
    if files is not None:
        certs = Path(files.cert).parent
        tls = (
            f", ssl=True, root_certificates={files.ca_files[0]!r},\n"
            f"      private_key={str(certs / 'client.key')!r}, "
            f"certificate_chain={str(certs / 'client.pem')!r}"
        )
    return f"""
Triton over gRPC (tritonclient.grpc):
  import json, numpy as np, tritonclient.grpc as g
  c = g.InferenceServerClient("localhost:{listener.port}"{tls})
  text = g.InferInput("text_input", [1], "BYTES")
  text.set_data_from_numpy(np.array([b"Hello"], dtype=object))
  params = g.InferInput("sampling_parameters", [1], "BYTES")
  params.set_data_from_numpy(np.array([json.dumps({{"max_tokens": 16}}).encode()], dtype=object))
  c.start_stream(callback=lambda result, error: print(error or result.as_numpy("text_output")))
  c.async_stream_infer("a1", [text, params]); c.stop_stream()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, default=Path("config.json"))
    args = parser.parse_args()
    settings = load_settings(config_path=args.config, environ={}).settings
    print(examples(settings))  # noqa: T201 - this module's purpose is printing


if __name__ == "__main__":
    main()
