"""Tool calls on /v1/chat/completions (fake engine): plans, forced JSON, auto parsing, streams."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from protocols.common.tools import scan_calls
from protocols.openai_v1 import schema, tools
from server.core.errors import InvalidRequest
from server.core.types import ChatPrompt
from server.engines.fake import FakeEngine
from tests.unit.test_openai_translate import client_for, make_context

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}},
]
CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"paris"}}</tool_call>'
MESSAGES = [{"role": "user", "content": "weather?"}]


def engine(**parsers: str) -> FakeEngine:
    return FakeEngine(model_name="tiny", **parsers)  # type: ignore[arg-type]


@pytest.fixture
async def hermes() -> AsyncIterator[tuple[httpx.AsyncClient, FakeEngine]]:
    fake = engine(tool_call_parser="hermes")
    async with await client_for(make_context(fake)) as http:
        yield http, fake


@pytest.fixture
async def plain() -> AsyncIterator[httpx.AsyncClient]:
    async with await client_for(make_context()) as http:
        yield http


async def chat(http: httpx.AsyncClient, **fields: Any) -> httpx.Response:
    return await http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 40, **fields}
    )


async def stream(http: httpx.AsyncClient, **fields: Any) -> list[ChatCompletionChunk]:
    response = await chat(http, stream=True, **fields)
    assert response.status_code == 200, response.text
    chunks = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(ChatCompletionChunk.model_validate_json(line[6:]))
    return chunks


def joined_calls(chunks: list[ChatCompletionChunk]) -> list[dict[str, str]]:
    """Tool-call deltas accumulated as the SDK's helpers do."""
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def finish_reasons(chunks: list[ChatCompletionChunk]) -> list[str]:
    return [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]


# ---- forced calls ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_named_function_gets_arguments_valid_for_its_schema(
    plain: httpx.AsyncClient,
) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = await chat(plain, tools=TOOLS, tool_choice=choice)
    assert response.status_code == 200, response.text
    body = ChatCompletion.model_validate(response.json())
    message = body.choices[0].message
    assert message.content == ""
    assert body.choices[0].finish_reason == "stop"  # a named function: "stop", as vLLM
    [call] = message.tool_calls or []
    assert call.id.startswith("chatcmpl-tool-") and len(call.id) == len("chatcmpl-tool-") + 16
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_named_stream_joins_to_the_whole_answer(plain: httpx.AsyncClient) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = (await chat(plain, tools=TOOLS, tool_choice=choice)).json()
    chunks = await stream(plain, tools=TOOLS, tool_choice=choice)
    [call] = joined_calls(chunks)
    expected = whole["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (call["name"], call["arguments"]) == (expected["name"], expected["arguments"])
    first = next(c for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    head = first.choices[0].delta.tool_calls[0]  # type: ignore[index]
    assert head.id and head.type == "function" and head.function.name == "get_weather"  # type: ignore[union-attr]
    assert finish_reasons(chunks) == ["stop"]


@pytest.mark.anyio
async def test_required_calls_validate_and_finish_with_tool_calls(
    plain: httpx.AsyncClient,
) -> None:
    response = await chat(plain, tools=TOOLS, tool_choice="required")
    body = response.json()
    assert response.status_code == 200, body
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    chunks = await stream(plain, tools=TOOLS, tool_choice="required")
    [streamed] = joined_calls(chunks)
    assert (streamed["name"], streamed["arguments"]) == (
        call["function"]["name"], call["function"]["arguments"],
    )
    assert finish_reasons(chunks) == ["tool_calls"]


def test_required_schema_is_vllm_s_and_parallel_false_allows_one_call() -> None:
    body = schema.ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
         "parallel_tool_calls": False}
    )
    plan = tools.chat_plan(body, tool_call_parser=None)
    structured = plan.structured()
    assert structured is not None and structured.fit_budget
    required = json.loads(structured.json_schema or "")
    assert required["minItems"] == 1 and required["maxItems"] == 1
    assert [b["properties"]["name"]["enum"] for b in required["items"]["anyOf"]] == [
        ["get_weather"], ["add"],
    ]


NESTED_TOOL = {"type": "function", "function": {"name": "trip", "parameters": {
    "type": "object",
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}}},
    "properties": {"to": {"$ref": "#/$defs/Place"}}, "required": ["to"]}}}


def test_required_schema_lifts_the_tools_definitions_to_its_top_as_vllm() -> None:
    """A tool's `#/$defs/...` references resolve from the calls' schema root
    (vLLM's `_get_tool_schema_defs`); two tools may share a definition, not redefine it."""
    body = schema.ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": [*TOOLS, NESTED_TOOL], "tool_choice": "required"}
    )
    structured = tools.chat_plan(body, tool_call_parser=None).structured()
    assert structured is not None
    required = json.loads(structured.json_schema or "")
    assert required["$defs"] == {"Place": NESTED_TOOL["function"]["parameters"]["$defs"]["Place"]}
    nested = required["items"]["anyOf"][2]["properties"]["parameters"]
    assert "$defs" not in nested and nested["properties"]["to"] == {"$ref": "#/$defs/Place"}
    other = json.loads(json.dumps(NESTED_TOOL))
    other["function"]["name"] = "other"
    other["function"]["parameters"]["$defs"]["Place"] = {"type": "string"}
    clash = schema.ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": [NESTED_TOOL, other], "tool_choice": "required"}
    )
    with pytest.raises(InvalidRequest, match="'Place' has multiple schemas"):
        tools.chat_plan(clash, tool_call_parser=None).structured()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[{"name":"add","parameters":{"a":1,"b":2}}]', [("add", '{"a":1,"b":2}', True)]),
        ('[{"name":"add","parameters":{"a":1', [("add", '{"a":1', False)]),
        ('[{"name":"ad', []),
        ('[ {"name": "a", "parameters": {}} , {"name": "b", "parameters": {"x": "}"}}]',
         [("a", "{}", True), ("b", '{"x": "}"}', True)]),
        ("not json", []),
    ],
)
def test_scan_calls_reads_finished_and_unfinished_answers(
    text: str, expected: list[tuple[str, str, bool]]
) -> None:
    assert scan_calls(text) == expected


# ---- auto ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_auto_without_a_parser_names_the_setting(plain: httpx.AsyncClient) -> None:
    response = await chat(plain, tools=TOOLS)  # no tool_choice with tools: "auto"
    assert response.status_code == 400
    error = response.json()["error"]
    assert "ModelConfig.toolCallParser" in error["message"]
    assert error["param"] == "tool_choice"


@pytest.mark.anyio
async def test_auto_parses_calls_out_of_the_text(
    hermes: tuple[httpx.AsyncClient, FakeEngine],
) -> None:
    http, _ = hermes
    messages = [{"role": "user", "content": CALL}]
    response = await http.post(
        "/v1/chat/completions",
        json={"messages": messages, "tools": TOOLS, "max_tokens": 2},
    )
    body = response.json()
    assert response.status_code == 200, body
    message = body["choices"][0]["message"]
    assert message["content"] == "user: "  # the fake echoes the prompt: text before the call
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "paris"}'}
    assert call["id"].startswith("chatcmpl-tool-") or call["id"].startswith("fake-call-")
    chunks_response = await http.post(
        "/v1/chat/completions",
        json={"messages": messages, "tools": TOOLS, "max_tokens": 2, "stream": True},
    )
    chunks = [
        ChatCompletionChunk.model_validate_json(line[6:])
        for line in chunks_response.text.splitlines()
        if line.startswith("data: {")
    ]
    [streamed] = joined_calls(chunks)
    assert (streamed["name"], streamed["arguments"]) == ("get_weather", '{"city": "paris"}')
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "user: "
    assert finish_reasons(chunks) == ["length"]  # the fake ran out of tokens, it did not stop


@pytest.mark.anyio
async def test_tool_choice_none_keeps_tools_in_the_prompt_and_answers_text(
    hermes: tuple[httpx.AsyncClient, FakeEngine],
) -> None:
    http, fake = hermes
    response = await chat(http, tools=TOOLS, tool_choice="none")
    assert response.status_code == 200
    assert "tool_calls" not in response.json()["choices"][0]["message"]
    prompt = fake.requests[-1].prompt
    assert isinstance(prompt, ChatPrompt) and prompt.tools is not None
    rendered = json.loads(prompt.tools)
    assert rendered[1] == {"type": "function", "function": {
        "name": "add", "description": "a + b", "parameters": TOOLS[1]["function"]["parameters"],  # type: ignore[index]
    }}


@pytest.mark.anyio
async def test_history_calls_and_results_reach_the_prompt(
    hermes: tuple[httpx.AsyncClient, FakeEngine],
) -> None:
    http, fake = hermes
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "rome"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    response = await http.post(
        "/v1/chat/completions", json={"messages": history, "tools": TOOLS, "tool_choice": "none"}
    )
    assert response.status_code == 200, response.text
    prompt = fake.requests[-1].prompt
    assert isinstance(prompt, ChatPrompt)
    assistant, tool = prompt.messages[1], prompt.messages[2]
    assert assistant.tool_calls[0].arguments == '{"city":"rome"}'
    assert (tool.role, tool.content, tool.tool_call_id) == ("tool", "sunny", "call_1")


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": []}, "tools", "must not be an empty array"),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "Invalid value"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "does not match any of the specified `tools`"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function",
         "Invalid value for `function`"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
         "tool_choice.function.name", "Expected field `name`"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "strng"}}}}}],
          "tool_choice": "required"},
         "tools.0.function.parameters", "not a valid JSON schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "array", "items": {}}}}], "tool_choice": "required"},
         "tools.0.function.parameters", "JSON object"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}],
          "tools": TOOLS, "tool_choice": "none"}, "messages.1.tool_call_id", "tool_call_id"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "custom", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages.0.tool_calls.0.type", "type 'function'"),
    ],
)
async def test_bad_tool_input_is_a_400_naming_the_field(
    plain: httpx.AsyncClient, fields: dict[str, Any], param: str, words: str
) -> None:
    response = await chat(plain, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert (await chat(plain)).status_code == 200  # and the engine serves right after


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web", "function": {"name": "f"}}]}, "body.tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "body.tools.0.function.parameters"),
        ({"tools": [{"type": "function"}]}, "body.tools.0.function"),
    ],
)
async def test_malformed_tools_are_field_errors(
    plain: httpx.AsyncClient, fields: dict[str, Any], param: str
) -> None:
    response = await chat(plain, **fields)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("Bad Request", param)


@pytest.mark.anyio
@pytest.mark.parametrize("field", ["tools", "tool_choice"])
async def test_completions_refuse_tools(plain: httpx.AsyncClient, field: str) -> None:
    value = TOOLS if field == "tools" else "auto"
    response = await plain.post("/v1/completions", json={"prompt": "hi", field: value})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


def test_tool_choice_null_with_tools_means_auto() -> None:
    body = schema.ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": TOOLS, "tool_choice": None}
    )
    assert tools.chat_plan(body, tool_call_parser="hermes").mode == "auto"
    with pytest.raises(InvalidRequest, match="toolCallParser"):
        tools.chat_plan(body, tool_call_parser=None)


# ---- reasoning and the model's defaults -------------------------------------------------------


@pytest.mark.anyio
async def test_reasoning_parser_splits_whole_and_streamed_answers() -> None:
    fake = engine(reasoning_parser="qwen3")
    async with await client_for(make_context(fake)) as http:
        messages = [{"role": "user", "content": "<think>because</think>answer"}]
        body = {"messages": messages, "max_tokens": 2}  # "user: <think>because</think>answer "
        whole = (await http.post("/v1/chat/completions", json=body)).json()
        message = whole["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("because", "user: answer ")
        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = [
            json.loads(line[6:]) for line in streamed.text.splitlines()
            if line.startswith("data: {")
        ]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning", "") for d in deltas) == "because"
        assert "".join(d.get("content", "") for d in deltas) == "user: answer "
        hidden = await http.post(
            "/v1/chat/completions", json={**body, "include_reasoning": False}
        )
        assert hidden.json()["choices"][0]["message"]["reasoning"] is None


@pytest.mark.anyio
async def test_reasoning_effort_reaches_the_template_with_enable_thinking(
    hermes: tuple[httpx.AsyncClient, FakeEngine],
) -> None:
    http, fake = hermes
    await chat(http, reasoning_effort="low", chat_template_kwargs={"x": 1})
    prompt = fake.requests[-1].prompt
    assert isinstance(prompt, ChatPrompt)
    assert dict(prompt.chat_template_kwargs) == {
        "x": 1, "reasoning_effort": "low", "enable_thinking": True,
    }
    await chat(http, reasoning_effort="none")
    prompt = fake.requests[-1].prompt
    assert isinstance(prompt, ChatPrompt)
    assert dict(prompt.chat_template_kwargs)["enable_thinking"] is False


@pytest.mark.anyio
async def test_omitted_sampling_fields_take_the_model_defaults(tmp_path: Any) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1,
                    "max_new_tokens": 7})
    )
    fake = FakeEngine(model_name="tiny", model_path=str(tmp_path))
    async with await client_for(make_context(fake)) as http:
        response = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert response.json()["usage"]["completion_tokens"] == 7  # the model's max_new_tokens
        sampling = fake.requests[-1].sampling
        assert (sampling.temperature, sampling.top_p, sampling.top_k,
                sampling.repetition_penalty) == (0.6, 0.8, 20, 1.1)
        await http.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0, "top_k": -1}
        )
        sampling = fake.requests[-1].sampling
        assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.0, -1, 0.8)
        await http.post("/v1/completions", json={"prompt": "hi"})
        assert fake.requests[-1].sampling.max_new_tokens == 16  # completions: vLLM's 16
        assert fake.requests[-1].sampling.temperature == 0.6


# TGI's router wants `properties` in a JSON grammar (protocols/common/grammar.py)
OBJECT = {"type": "object", "properties": {}}
OBJECT_TEXT = '{"type":"object","properties":{}}'


@pytest.mark.parametrize(
    ("fmt", "field", "value"),
    [
        ({"type": "json", "value": OBJECT}, "json_schema", OBJECT_TEXT),
        ({"type": "json_object", "value": '{"type": "object", "properties": {}}'}, "json_schema",
         OBJECT_TEXT),
        ({"type": "json_schema", "value": {"name": "x", "schema": OBJECT}},
         "json_schema", OBJECT_TEXT),
        ({"type": "regex", "value": "[a-z]+"}, "regex", "[a-z]+"),
    ],
)
def test_tgi_response_formats_on_chat(fmt: dict[str, Any], field: str, value: str) -> None:
    from protocols.openai_v1.structured import to_structured

    body = schema.ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "response_format": fmt}
    )
    structured = to_structured(body)
    assert structured is not None and getattr(structured, field) == value


def test_a_tgi_response_format_gets_the_tgi_routers_schema_checks() -> None:
    from protocols.openai_v1.structured import to_structured

    body = schema.ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "response_format": {"type": "json", "value": {"type": "object"}}}
    )
    with pytest.raises(InvalidRequest) as caught:
        to_structured(body)
    assert caught.value.message == "grammar is not valid: Grammar must have a 'properties' field"
    assert caught.value.param == "response_format"


def test_a_bad_tgi_response_format_names_the_field() -> None:
    from protocols.openai_v1.structured import to_structured

    body = schema.ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "response_format": {"type": "json", "value": [1]}}
    )
    with pytest.raises(InvalidRequest) as caught:
        to_structured(body)
    assert caught.value.param == "response_format"


@pytest.mark.anyio
async def test_prompt_logprobs_in_vllm_s_shape(plain: httpx.AsyncClient) -> None:
    done = await plain.post(
        "/v1/completions", json={"prompt": "the sky is", "max_tokens": 2, "prompt_logprobs": 1}
    )
    rows = done.json()["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == 3
    [(token_id, entry)] = rows[1].items()
    assert token_id.isdigit() and entry == {"logprob": -1.0, "rank": 1, "decoded_token": "sky"}
    chat_rows = (await chat(plain, prompt_logprobs=0)).json()["prompt_logprobs"]
    assert chat_rows[0] is None and all(isinstance(row, dict) for row in chat_rows[1:])
    too_many = await chat(plain, prompt_logprobs=99)
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "prompt_logprobs"
