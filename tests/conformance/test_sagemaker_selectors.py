"""DJL / SageMaker adapter selectors on every body shape, on the real server process and the REAL
vLLM engine, through real sockets (protocols/common/sagemaker.py has the precedence).

Every selector (body `adapters`, `?adapter=`, `X-Amzn-SageMaker-Custom-Attributes: adapter=`,
`X-Amzn-SageMaker-Adapter-Identifier`) on every body shape of `/invocations` and
`/predictions/{m}` (LMI `inputs`, chat `messages`, completion `prompt`; TGI's `inputs` on a
server started with DJL's OPTION_TGI_COMPAT=true), streamed and not, gives the greedy output of
the same adapter selected the ordinary way: OpenAI `model` through the openai SDK, TGI
`adapter_id` through huggingface_hub's InferenceClient. Demo adapters a1-a3 differ from the base.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam
from text_generation import Client  # type: ignore[import-untyped]

from tests.serverproc import DEMO_WORKFLOW, RunningServer

pytestmark = pytest.mark.server

PROMPT = "the quick brown fox jumps over"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
TOKENS = 8
ADAPTERS = ("a1", "a2", "a3")
IDENTIFIER = "X-Amzn-SageMaker-Adapter-Identifier"
ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"
BODIES: dict[str, dict[str, Any]] = {  # greedy in each protocol
    "lmi": {"inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS}},
    "chat": {"messages": MESSAGES, "max_tokens": TOKENS, "temperature": 0},
    "completion": {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0},
}


@pytest.fixture(scope="module")
def data(live_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def ordinary(live_server: RunningServer) -> dict[str, dict[str, str]]:
    """Greedy text per shape and model ("" = base), the adapter chosen by OpenAI's `model`
    through the openai SDK (an LMI `inputs` body is a completion of the same prompt)."""
    with OpenAI(base_url=f"{live_server.url}/v1", api_key="EMPTY", max_retries=0) as sdk:
        def chat(model: str) -> str:
            answer = sdk.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=TOKENS, temperature=0)
            return answer.choices[0].message.content or ""

        def complete(model: str) -> str:
            answer = sdk.completions.create(
                model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
            return answer.choices[0].text

        texts = {name: (chat(name or "tiny"), complete(name or "tiny"))
                 for name in ("", *ADAPTERS)}
    return {"chat": {n: t[0] for n, t in texts.items()},
            "completion": {n: t[1] for n, t in texts.items()},
            "lmi": {n: t[1] for n, t in texts.items()}}


def test_each_adapter_differs_from_the_base_on_every_shape(
    ordinary: dict[str, dict[str, str]],
) -> None:
    for texts in ordinary.values():
        assert len(set(texts.values())) == 1 + len(ADAPTERS), texts


def selector(way: str, name: str) -> dict[str, Any]:
    """How `way` names `name`: extra body fields, query parameters, headers."""
    return {
        "body adapters": {"body": {"adapters": name}},
        "query": {"params": {"adapter": name}},
        "custom attributes": {"headers": {ATTRIBUTES: f"tenant=t1;adapter={name}"}},
        "identifier header": {"headers": {IDENTIFIER: name}},
    }[way]


def invoke(
    http: httpx.Client, shape: str, path: str, *, stream: bool, body: dict[str, Any] | None = None,
    params: dict[str, str] | None = None, headers: dict[str, str] | None = None,
) -> str:
    """The generated text of one request, read from its JSON answer or its stream."""
    sent = {**BODIES[shape], **(body or {}), **({"stream": True} if stream else {})}
    with http.stream("POST", path, json=sent, params=params, headers=headers) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    if not stream:
        return answer_text(shape, json.loads("".join(lines)))
    if shape == "lmi":  # JSON lines; the last carries the whole text
        chunks = [json.loads(line) for line in lines]
        text = "".join(chunk["token"]["text"] for chunk in chunks)
        assert chunks[-1]["generated_text"] == text
        return text
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    return "".join(chunk_text(shape, chunk) for chunk in chunks)


def answer_text(shape: str, answer: dict[str, Any]) -> str:
    if shape == "lmi":
        text: str = answer["generated_text"]
    elif shape == "chat":
        text = answer["choices"][0]["message"]["content"]
    else:
        text = answer["choices"][0]["text"]
    return text


def chunk_text(shape: str, chunk: dict[str, Any]) -> str:
    if not chunk["choices"]:
        return ""
    choice = chunk["choices"][0]
    text: str = (choice["delta"].get("content") or "") if shape == "chat" else choice["text"]
    return text


WAYS = ("body adapters", "query", "custom attributes", "identifier header")
PATHS = ("/invocations", "/predictions/tiny")
CASES = [(shape, way, path, stream, ADAPTERS[(i + j + k) % len(ADAPTERS)])
         for shape in BODIES for i, way in enumerate(WAYS) for j, path in enumerate(PATHS)
         for k, stream in enumerate((False, True))]


@pytest.mark.parametrize(("shape", "way", "path", "stream", "adapter"), CASES)
def test_every_selector_on_every_body_shape_runs_the_adapter(
    data: httpx.Client, ordinary: dict[str, dict[str, str]],
    shape: str, way: str, path: str, stream: bool, adapter: str,
) -> None:
    text = invoke(data, shape, path, stream=stream, **selector(way, adapter))
    assert text == ordinary[shape][adapter]


@pytest.mark.parametrize("shape", list(BODIES))
def test_the_later_selector_wins_and_a_workflow_runs_its_adapter(
    data: httpx.Client, ordinary: dict[str, dict[str, str]], shape: str
) -> None:
    expected = ordinary[shape]
    body, query = {"adapters": "a1"}, {"adapter": "a2"}
    attributes = {ATTRIBUTES: "adapter=a3"}
    assert invoke(data, shape, "/invocations", stream=False, body=body, params=query,
                  headers=attributes) == expected["a3"]
    both = {**attributes, IDENTIFIER: "a1"}
    assert invoke(data, shape, "/invocations", stream=True, body=body, params=query,
                  headers=both) == expected["a1"]
    base = {**attributes, IDENTIFIER: ""}  # the header names the base model
    assert invoke(data, shape, "/invocations", stream=False, body=body, params=query,
                  headers=base) == expected[""]
    # the workflow (base + a2) by path or ?model_name=, and `?adapter=` over it (DJL's order)
    assert invoke(data, shape, f"/predictions/{DEMO_WORKFLOW}", stream=True) == expected["a2"]
    assert invoke(data, shape, "/invocations", stream=False,
                  params={"model_name": DEMO_WORKFLOW}) == expected["a2"]
    assert invoke(data, shape, f"/predictions/{DEMO_WORKFLOW}", stream=False,
                  params={"adapter": "a3"}) == expected["a3"]


def test_a_selector_that_cannot_apply_is_an_error_never_the_base(data: httpx.Client) -> None:
    def post(shape: str, **kwargs: Any) -> httpx.Response:
        body = {**BODIES[shape], **kwargs.pop("body", {})}
        return data.post("/invocations", json=body, **kwargs)

    unknown = {"params": {"adapter": "zz"}}
    lmi = post("lmi", **unknown)  # djl_python / ModelInfo.java: 424
    assert (lmi.status_code, lmi.json()) == (424, {"error": "Adapter zz is not registered",
                                                   "code": 424})
    for shape in ("chat", "completion"):  # answered by OpenAI's routes, as vLLM's SageMaker
        refused = post(shape, headers={ATTRIBUTES: "adapter=zz"})
        assert refused.status_code == 404
        assert refused.json()["error"]["message"].startswith("The model `zz` does not exist.")
        listed = post(shape, body={"adapters": ["a1", "a2"]})
        assert listed.status_code == 400
        assert listed.json()["error"]["message"] == (
            "Number of adapters is not equal to the number of inputs")
    mismatch = post("lmi", body={"inputs": [PROMPT, PROMPT], "adapters": ["a1"]})
    assert mismatch.status_code == 424
    empty = post("chat", params={"adapter": ""})
    assert empty.status_code == 404 and "?adapter= is empty" in empty.text


# ---- TGI's body on /invocations with DJL's option.tgi_compat -------------------------------------

@pytest.fixture(scope="module")
def compat_server(djl_options_server: RunningServer) -> RunningServer:
    return djl_options_server


TGI_WAYS = ("query", "custom attributes", "identifier header")


@pytest.mark.parametrize("way", TGI_WAYS)
def test_with_tgi_compat_every_selector_runs_the_adapter_through_tgis_client(
    compat_server: RunningServer, way: str
) -> None:
    """text_generation.Client posts to its base URL (which may carry `?adapter=`) with its
    headers; the reference is TGI's own `adapter_id`, sent by huggingface_hub to `POST /`."""
    url = compat_server.url
    hub = InferenceClient(base_url=url, timeout=60)
    base = hub.text_generation(PROMPT, max_new_tokens=TOKENS, return_full_text=False)
    for adapter in ADAPTERS:
        expected = hub.text_generation(
            PROMPT, max_new_tokens=TOKENS, return_full_text=False, adapter_id=adapter)
        assert expected != base
        sent = selector(way, adapter)
        query = f"?{httpx.QueryParams(sent['params'])}" if "params" in sent else ""
        client = Client(f"{url}/invocations{query}", headers=sent.get("headers"), timeout=60)
        assert client.generate(PROMPT, max_new_tokens=TOKENS).generated_text == expected
        tokens = list(client.generate_stream(PROMPT, max_new_tokens=TOKENS))
        assert tokens[-1].generated_text == expected


def test_with_tgi_compat_selectors_win_over_adapter_id_and_unknown_names_are_tgis_422(
    compat_server: RunningServer,
) -> None:
    with httpx.Client(base_url=compat_server.url, timeout=60) as http:
        def generated(adapter_id: str, **kwargs: Any) -> httpx.Response:
            parameters = {"max_new_tokens": TOKENS, "adapter_id": adapter_id,
                          "return_full_text": False}
            return http.post("/invocations", json={"inputs": PROMPT, "parameters": parameters},
                             **kwargs)

        a2 = generated("a2").json()
        assert generated("a1", params={"adapter": "a2"}).json() == a2
        assert generated("a1", headers={ATTRIBUTES: "adapter=a2"}).json() == a2
        refused = generated("a1", params={"adapter": "zz"})
        assert refused.status_code == 422 and refused.json()["error_type"] == "validation"
        no_workflow = generated("a1", params={"model_name": DEMO_WORKFLOW})  # none here
        assert no_workflow.status_code == 422
        assert "Model or workflow not found: tiny-a2" in no_workflow.json()["error"]
        assert generated("a1").json() != a2
