"""Tool calls and the Responses API on the real engine, driven by the official clients: the
`openai` SDK (chat and Responses, sync and streamed), the OpenAI Agents SDK, LangChain's
ChatOpenAI and huggingface_hub's InferenceClient. The demo model is random: forced calls
(`required`, a named function) are constrained by the gateway; `auto` calls are forced into
Hermes markup with a regex so that vLLM's own Hermes parser finds them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

from tests.serverproc import RunningServer

pytestmark = [pytest.mark.engine, pytest.mark.server]

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
AUTO_CALL = (
    r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "[a-z]{3,6}", "days": [1-9]\}\}</tool_call>'
)
GREEDY: dict[str, Any] = {"temperature": 0, "seed": 7}
R_GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"seed": 7}}  # Responses: no `seed`


@pytest.fixture(scope="module")
def client(live_server: RunningServer) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{live_server.url}/v1", api_key="EMPTY", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def http(live_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=120) as raw:
        yield raw


def streamed_calls(stream: Any) -> tuple[list[dict[str, str]], str, list[str]]:
    """Accumulated tool calls, text and finish reasons of a chat stream."""
    calls: dict[int, dict[str, str]] = {}
    text, finishes = "", []
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], text, finishes


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# ---- chat completions -------------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [None, 24, 200])
def test_a_named_function_always_gets_valid_arguments(client: OpenAI, max_tokens: Any) -> None:
    """vLLM's own server answers non-JSON arguments here on this model."""
    result = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
        max_tokens=max_tokens, **GREEDY,
    )
    choice = result.choices[0]
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    check_call("get_weather", call.function.arguments)  # type: ignore[union-attr]
    assert choice.message.content == "" and choice.finish_reason == "stop"


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_forced_calls_stream_exactly_what_they_answer(client: OpenAI, choice: Any) -> None:
    whole = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, **GREEDY
    )
    calls, text, finishes = streamed_calls(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, stream=True,
            **GREEDY,
        )
    )
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}  # type: ignore[union-attr]
        for c in whole.choices[0].message.tool_calls or []
    ]
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == expected
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert text == ""
    assert finishes == [whole.choices[0].finish_reason]
    for call in calls:
        check_call(call["name"], call["arguments"])


class Place(BaseModel):
    city: str


class Trip(BaseModel):  # pydantic writes `$defs` and `$ref` for the nested model
    to: Place
    via: list[Place]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "Trip"}}])
def test_tools_with_nested_models_get_arguments_their_model_parses(
    client: OpenAI, choice: Any
) -> None:
    """vLLM lifts the tools' `$defs` to the top of the forced schema; here the references are
    also inlined so the arguments are bounded like any other (no raw control characters)."""
    tool = openai.pydantic_function_tool(Trip)
    for seed in range(3):
        result = client.chat.completions.create(
            model="a2", messages=MESSAGES, tools=[tool], tool_choice=choice, max_tokens=80,
            temperature=1.0, seed=seed,
        )
        calls = result.choices[0].message.tool_calls or []
        assert calls
        for call in calls:
            Trip.model_validate_json(call.function.arguments)  # type: ignore[union-attr]


def test_required_with_parallel_calls_off_makes_one_valid_call(client: OpenAI) -> None:
    result = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, **GREEDY,
    )
    [call] = result.choices[0].message.tool_calls or []
    check_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]
    assert result.choices[0].finish_reason == "tool_calls"


def test_auto_calls_are_found_by_vllm_s_hermes_parser(client: OpenAI) -> None:
    forced = {"max_tokens": 120, "extra_body": {"structured_outputs": {"regex": AUTO_CALL}}}
    result = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, **GREEDY, **forced
    )
    message = result.choices[0].message
    [call] = message.tool_calls or []
    assert message.content == "Sure. "
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    check_call("get_weather", call.function.arguments)  # type: ignore[union-attr]
    assert result.choices[0].finish_reason == "tool_calls"
    calls, text, finishes = streamed_calls(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, stream=True, **GREEDY, **forced
        )
    )
    assert text == "Sure. "
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", json.loads(call.function.arguments))  # type: ignore[union-attr]
    ]
    assert finishes == ["tool_calls"]


def test_tool_choice_none_answers_text(client: OpenAI) -> None:
    result = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8, **GREEDY
    )
    assert result.choices[0].message.tool_calls is None
    assert result.choices[0].message.content


def test_a_tool_round_trip_with_the_sdk(client: OpenAI) -> None:
    first = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", **GREEDY
    )
    [call] = first.choices[0].message.tool_calls or []
    history = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    follow = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, **GREEDY
    )
    assert follow.choices[0].message.content
    without_history = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8, **GREEDY
    )
    assert follow.usage.prompt_tokens > without_history.usage.prompt_tokens  # type: ignore[union-attr]


def test_an_adapter_makes_forced_calls_too(client: OpenAI) -> None:
    result = client.chat.completions.create(
        model="a1", messages=MESSAGES, tools=TOOLS, tool_choice="required", **GREEDY
    )
    assert result.model == "a1"
    for call in result.choices[0].message.tool_calls or []:
        check_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": 7}}}}}], "tool_choice": "required"},
         "tools.0.function.parameters"),
        ({"messages": [*MESSAGES, {"role": "tool", "content": "42"}]}, "messages.1.tool_call_id"),
        ({"tools": []}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400s_and_the_engine_serves_on(
    client: OpenAI, fields: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param  # type: ignore[index]
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices


def test_tools_on_completions_are_refused(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "tools": TOOLS})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools"


# ---- the Responses API ------------------------------------------------------------------------

FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]


def test_responses_text_and_stream_agree(client: OpenAI) -> None:
    whole = client.responses.create(
        model="tiny", input="Hello", instructions="Be brief", max_output_tokens=10, **R_GREEDY
    )
    assert whole.status == "incomplete" and whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens == 10
    events = list(
        client.responses.create(
            model="tiny", input="Hello", instructions="Be brief", max_output_tokens=10,
            stream=True, **R_GREEDY,
        )
    )
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_responses_logprobs_and_vllm_extras_on_the_engine(client: OpenAI) -> None:
    """vLLM applies `ignore_eos` and friends on Responses and returns the text's logprobs
    with `include`; an adapter, so the LoRA path runs them too."""
    asked: dict[str, Any] = {
        "model": "a1", "input": "Hello", "max_output_tokens": 12, "temperature": 0,
        "include": ["message.output_text.logprobs"], "top_logprobs": 2,
        "extra_body": {"ignore_eos": True, "seed": 7},
    }
    whole = client.responses.create(**asked)
    assert whole.usage is not None and whole.usage.output_tokens == 12  # never an early EOS
    part = whole.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs is not None and len(part.logprobs) == 12  # type: ignore[union-attr]
    for entry in part.logprobs:  # type: ignore[union-attr]
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
    assert whole.top_logprobs == 2
    events = list(client.responses.create(**asked, stream=True))
    streamed = [lp.token for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert streamed == [lp.token for lp in part.logprobs]  # type: ignore[union-attr]


def test_responses_adapter_is_selected_and_echoed(client: OpenAI) -> None:
    base = client.responses.create(model="tiny", input="Hello", max_output_tokens=6, **R_GREEDY)
    lora = client.responses.create(model="a2", input="Hello", max_output_tokens=6, **R_GREEDY)
    assert lora.model == "a2" and base.model == "tiny"
    assert lora.output_text != base.output_text


def test_responses_function_tool_round_trip(client: OpenAI) -> None:
    first = client.responses.create(
        model="tiny", input="Weather in Paris?", tools=FUNCTIONS, tool_choice="required",
        **R_GREEDY,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        check_call(call.name, call.arguments)
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
               for c in calls],
        tools=FUNCTIONS,
        tool_choice="none",
        max_output_tokens=8,
        **R_GREEDY,
    )
    assert second.output_text and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).id == first.id


def test_responses_streamed_function_call(client: OpenAI) -> None:
    events = list(
        client.responses.create(
            model="tiny", input="Weather?", tools=FUNCTIONS,
            tool_choice={"type": "function", "name": "add"}, stream=True, **R_GREEDY,
        )
    )
    deltas = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == deltas
    check_call("add", deltas)
    final = events[-1].response
    assert [(item.type, item.name) for item in final.output] == [("function_call", "add")]


def test_responses_bad_input_in_openai_shape(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="x", tool_choice="required")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")
    assert client.responses.create(model="tiny", input="x", max_output_tokens=2).output_text


# ---- agent frameworks -------------------------------------------------------------------------


def test_openai_agents_sdk_runs_a_function_tool(live_server: RunningServer) -> None:
    """One agent turn forced to call the tool, then a text answer (the SDK resets the tool
    choice after a call), over the Responses API and over chat completions."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    seen: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: str, days: int) -> str:
        """The weather in a city."""
        seen.append((city, days))
        return f"sunny in {city}"

    sdk = AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="EMPTY", max_retries=0)
    for model in (
        OpenAIResponsesModel(model="tiny", openai_client=sdk),
        OpenAIChatCompletionsModel(model="tiny", openai_client=sdk),
    ):
        agent = Agent(
            name="weather",
            instructions="Answer with the weather.",
            tools=[get_weather],
            model=model,
            # the second turn (tool choice reset to auto) answers a fixed sentence and stops
            model_settings=ModelSettings(
                tool_choice="required", temperature=0, max_tokens=100,
                extra_body={"structured_outputs": {"regex": "It is sunny[.]"}},
            ),
        )
        before = len(seen)
        result = Runner.run_sync(agent, "Weather in Paris?", max_turns=3)
        assert len(seen) == before + 1, result
        assert result.final_output == "It is sunny."


def test_langchain_bind_tools(live_server: RunningServer) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(
        model="tiny", base_url=f"{live_server.url}/v1", api_key="EMPTY", temperature=0,
        max_retries=0,
    )
    message = llm.bind_tools([add], tool_choice="add").invoke("What is 2 + 3?")
    [call] = message.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "add"
    jsonschema.validate(call["args"], ADD)
    streamed = None
    for chunk in llm.bind_tools([add], tool_choice="add").stream("What is 2 + 3?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and streamed.tool_calls[0]["args"] == call["args"]  # type: ignore[attr-defined]


def test_huggingface_hub_chat_completion(live_server: RunningServer) -> None:
    """InferenceClient(base_url=...) sends `model: "dummy"`, a configured base-model alias."""
    from huggingface_hub import InferenceClient

    hub = InferenceClient(base_url=live_server.url)
    whole = hub.chat_completion(MESSAGES, max_tokens=6, temperature=0, seed=7)
    assert whole.model == "tiny" and whole.choices[0].message.content
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in hub.chat_completion(MESSAGES, max_tokens=6, temperature=0, seed=7, stream=True)
        if chunk.choices
    ]
    assert "".join(pieces) == whole.choices[0].message.content
    with pytest.raises(Exception, match=r"404|does not exist"):
        hub.chat_completion(MESSAGES, model="not-a-model", max_tokens=2)
    answer = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"]}
    shaped = hub.chat_completion(  # the hub sends it as TGI's {"type": "json_object", "value"}
        MESSAGES, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": answer}},
    )
    jsonschema.validate(json.loads(shaped.choices[0].message.content or ""), answer)


def test_prompt_logprobs_are_refused_where_the_engine_cannot(http: httpx.Client) -> None:
    """vLLM 0.32 on the CPU dies on prompt logprobs with LoRA enabled (this server has it)."""
    response = http.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 2, "prompt_logprobs": 1},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_logprobs"
    fine = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert fine.status_code == 200
