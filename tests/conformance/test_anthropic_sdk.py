"""The official `anthropic` SDK against the gateway process on the real vLLM engine (tiny demo
model, adapters a1-a3, the Hermes tool-call parser): messages.create and messages.stream, an
adapter as `model` answering as it does on /v1/chat/completions, stop sequences, forced tool
calls held to their schema, a tool_result round trip, count_tokens, structured outputs
(`output_config.format`, `messages.parse`) and `output_config.effort`, and every error the
gateway can give a Messages client in Anthropic's shape and the SDK's exception types."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import anthropic
import jsonschema
import openai
import pydantic
import pytest
from openai import OpenAI

from tests.serverproc import RunningServer
from tests.unit.test_anthropic_translate import FORMAT, MOOD, WEATHER

pytestmark = [pytest.mark.engine, pytest.mark.server]

SYSTEM = "You answer briefly."
TURNS: list[Any] = [
    {"role": "user", "content": "Tell me about the sky"},
    {"role": "assistant", "content": "It is blue."},
    {"role": "user", "content": "Why?"},
]
# Current SDKs send the sampling fields in `extra_body`.
GREEDY: dict[str, Any] = {"max_tokens": 12, "extra_body": {"temperature": 0}}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "Weather", "input_schema": WEATHER},
    {"name": "add", "input_schema": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}},
]
CALL = {"city": "Paris", "days": 2}
# The demo model writes JSON whitespace freely: greedy, it closes the object in under 100 tokens.
JSON_ASK: dict[str, Any] = {
    "model": "tiny", "messages": [{"role": "user", "content": "Answer in JSON:"}],
    "max_tokens": 200, "extra_body": {"temperature": 0},
}
BAD_SCHEMA: Any = {"type": "object", "properties": {"a": {"type": "frog"}}}
BAD_FORMAT: Any = {"type": "json_schema", "schema": BAD_SCHEMA}
ROUND_TRIP: list[Any] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": CALL}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "Sunny, 24 degrees"}]},
]


@pytest.fixture(scope="module")
def client(live_server: RunningServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=live_server.url, api_key="EMPTY", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def chat(live_server: RunningServer) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{live_server.url}/v1", api_key="EMPTY", max_retries=0) as sdk:
        yield sdk


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def assert_serving(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model="a1", max_tokens=2, messages=TURNS[:1])
    assert message.usage.output_tokens >= 1 and message.model == "a1"


# ---- answers -----------------------------------------------------------------------------------


def test_an_adapter_answers_as_on_chat_completions(
    client: anthropic.Anthropic, chat: OpenAI
) -> None:
    texts = {}
    for model in ("tiny", "a1"):
        message = client.messages.create(model=model, system=SYSTEM, messages=TURNS, **GREEDY)
        assert message.model == model and message.id.startswith("msg_")
        assert message._request_id  # the request-id header
        completion = chat.chat.completions.create(
            model=model, messages=[{"role": "system", "content": SYSTEM}, *TURNS], **GREEDY
        )
        assert text_of(message) == completion.choices[0].message.content
        assert completion.usage is not None
        assert message.usage.input_tokens == completion.usage.prompt_tokens
        assert message.usage.output_tokens == completion.usage.completion_tokens
        finish = completion.choices[0].finish_reason
        assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
        texts[model] = text_of(message)
    assert texts["tiny"] != texts["a1"]


def test_the_stream_is_the_non_streamed_answer(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="a2", system=SYSTEM, messages=TURNS, **GREEDY)
    with client.messages.stream(model="a2", system=SYSTEM, messages=TURNS, **GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert text_of(final) == text_of(whole)
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)


def test_sampling_fields_in_extra_body_reach_the_sampler(client: anthropic.Anthropic) -> None:
    """top_k 1 at temperature 1 is greedy only if it reaches the sampler."""
    greedy = client.messages.create(model="a1", messages=TURNS, **GREEDY)
    for _ in range(2):
        sampled = client.messages.create(
            model="a1", messages=TURNS, max_tokens=12, extra_body={"temperature": 1, "top_k": 1}
        )
        assert text_of(sampled) == text_of(greedy)


def test_a_stop_sequence_is_cut_and_named(client: anthropic.Anthropic) -> None:
    free = text_of(client.messages.create(model="tiny", messages=TURNS, **GREEDY))
    assert len(free) >= 8, free
    stop = free[4:7]
    cut = free[: free.index(stop)]
    message = client.messages.create(model="tiny", messages=TURNS, stop_sequences=[stop],
                                     **GREEDY)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert text_of(message) == cut
    with client.messages.stream(model="tiny", messages=TURNS, stop_sequences=[stop],
                                **GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == ("stop_sequence", stop, cut)


# ---- tools -------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_forced_tool_call_always_validates(client: anthropic.Anthropic, choice: Any) -> None:
    """vLLM's own server runs `any` to the token limit as unparsed markup on this model."""
    schemas = {tool["name"]: tool["input_schema"] for tool in TOOLS}
    message = client.messages.create(
        model="tiny", messages=ROUND_TRIP[:1], tools=TOOLS, tool_choice=choice, max_tokens=60,
        extra_body={"temperature": 0}, stop_sequences=["{", '"'],  # end text, not the input
    )
    assert message.stop_reason == "tool_use"
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls and len(calls) == len(message.content)
    for call in calls:
        jsonschema.validate(call.input, schemas[call.name])
    if choice["type"] == "tool":
        assert [call.name for call in calls] == ["get_weather"]
    with client.messages.stream(
        model="tiny", messages=ROUND_TRIP[:1], tools=TOOLS, tool_choice=choice, max_tokens=60,
        extra_body={"temperature": 0},
    ) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (call.name, call.input) for call in calls
    ]


def test_a_forced_call_cut_by_max_tokens_is_one_incomplete_tool_use_streamed_or_not(
    client: anthropic.Anthropic,
) -> None:
    """Anthropic answers an incomplete `tool_use` block under `max_tokens`, its input read as
    far as it goes, as the SDK's stream helper reads it."""
    cut = 0
    for max_tokens in (30, 36, 42):
        asked: dict[str, Any] = {
            "model": "tiny", "messages": ROUND_TRIP[:1], "tools": TOOLS,
            "tool_choice": {"type": "any"}, "max_tokens": max_tokens,
            "extra_body": {"temperature": 0},
        }
        message = client.messages.create(**asked)
        with client.messages.stream(**asked) as stream:
            final = stream.get_final_message()
        assert message.stop_reason == final.stop_reason
        blocks = [(b.type, getattr(b, "name", None), getattr(b, "input", None))
                  for b in message.content]
        assert blocks == [(b.type, getattr(b, "name", None), getattr(b, "input", None))
                          for b in final.content]
        if message.stop_reason == "max_tokens" and blocks[-1][0] == "tool_use":
            cut += 1
    assert cut, "no limit cut a call: the test asks too much of the demo model"


def test_a_tool_result_round_trip_is_the_chat_conversation(
    client: anthropic.Anthropic, chat: OpenAI
) -> None:
    """The tool_use and tool_result turns render exactly as OpenAI's tool_calls and tool
    messages do: same prompt tokens, same greedy answer."""
    message = client.messages.create(model="a1", messages=ROUND_TRIP, tools=TOOLS, **GREEDY)
    openai_tools = [{"type": "function", "function": {
        "name": t["name"], "description": t.get("description"), "parameters": t["input_schema"]}}
        for t in TOOLS]
    openai_messages: list[Any] = [
        ROUND_TRIP[0],
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "toolu_01", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":2}'}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "Sunny, 24 degrees"},
    ]
    completion = chat.chat.completions.create(
        model="a1", messages=openai_messages, tools=openai_tools, **GREEDY
    )
    assert completion.usage is not None
    assert message.usage.input_tokens == completion.usage.prompt_tokens
    assert text_of(message) == (completion.choices[0].message.content or "")
    counted = client.messages.count_tokens(model="a1", messages=ROUND_TRIP, tools=TOOLS)
    assert counted.input_tokens == message.usage.input_tokens


# ---- output_config -----------------------------------------------------------------------------


class Mood(pydantic.BaseModel):
    mood: Literal["good", "bad"]
    sure: bool


def test_an_output_format_holds_the_text_to_its_schema(client: anthropic.Anthropic) -> None:
    parsed = client.messages.parse(output_format=Mood, **JSON_ASK)  # sent as output_config
    assert isinstance(parsed.parsed_output, Mood) and parsed.stop_reason == "end_turn"
    whole = client.messages.create(output_config={"format": FORMAT}, **JSON_ASK)
    jsonschema.validate(json.loads(text_of(whole)), MOOD)
    with client.messages.stream(output_config={"format": FORMAT}, **JSON_ASK) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text_of(final) == text_of(whole) and len(pieces) > 1
    beta = client.post("/v1/messages", cast_to=object, body={  # the beta's own field
        **{k: v for k, v in JSON_ASK.items() if k != "extra_body"}, "temperature": 0,
        "output_format": FORMAT})
    assert isinstance(beta, dict) and beta["content"][0]["text"] == text_of(whole)


def test_a_forced_tool_call_wins_over_the_output_format(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        tools=TOOLS, tool_choice={"type": "tool", "name": "add"},
        output_config={"format": FORMAT}, **{**JSON_ASK, "max_tokens": 60},
    )
    [call] = message.content
    assert call.type == "tool_use" and call.name == "add"
    jsonschema.validate(call.input, TOOLS[1]["input_schema"])


def test_effort_reaches_the_template(client: anthropic.Anthropic) -> None:
    """The demo template writes `Reasoning: <effort>` and opens a think block for it."""
    plain = client.messages.count_tokens(model="tiny", messages=TURNS).input_tokens
    low = client.messages.count_tokens(
        model="tiny", messages=TURNS, output_config={"effort": "low"}
    ).input_tokens
    assert low > plain + 1
    message = client.messages.create(
        model="tiny", messages=TURNS, max_tokens=2, output_config={"effort": "low"}
    )
    assert message.usage.input_tokens == low
    off = client.messages.count_tokens(
        model="tiny", messages=TURNS, output_config={"effort": "max"},
        thinking={"type": "disabled"},
    )
    assert off.input_tokens == plain  # disabled thinking replaces the effort, as vLLM


def test_a_schema_the_engine_refuses_is_the_chat_paths_400(
    client: anthropic.Anthropic, chat: OpenAI
) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(output_config={"format": BAD_FORMAT}, **JSON_ASK)
    with pytest.raises(anthropic.BadRequestError) as streamed, client.messages.stream(
        output_config={"format": BAD_FORMAT}, **JSON_ASK
    ) as stream:
        stream.get_final_message()
    with pytest.raises(openai.BadRequestError) as openai_refused:
        chat.chat.completions.create(
            model="tiny", messages=TURNS, max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": BAD_SCHEMA}},
        )
    assert refused.value.body == streamed.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": 'Failed to transform json schema into a grammar: Unsupported type "frog"'}}
    assert openai_refused.value.body == {  # the OpenAI SDK's body is the `error` object
        "message": 'Failed to transform json schema into a grammar: Unsupported type "frog"',
        "type": "BadRequestError",
        "param": None, "code": 400}
    assert_serving(client)


def test_count_tokens_is_the_messages_input_tokens(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=TURNS)
    message = client.messages.create(model="tiny", system=SYSTEM, messages=TURNS, max_tokens=1)
    assert counted.input_tokens == message.usage.input_tokens > 10


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": "tiny", "messages": TURNS}, "max_tokens: Field required"),
        ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
         "messages.0.role"),
        ({"model": "tiny", "max_tokens": 4,
          "messages": [{"role": "user", "content": [{"type": "audio", "data": "x"}]}]},
         "'audio'"),
        ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}]}]},
         "text only"),
        ({"model": "tiny", "max_tokens": 4, "messages": TURNS, "tools": TOOLS,
          "tool_choice": {"type": "tool", "name": "nope"}}, "not in `tools`"),
        ({"model": "tiny", "max_tokens": 4, "messages": TURNS,
          "output_config": {"format": {"type": "json_object", "schema": MOOD}}},
         "output_config.format.type: Input should be 'json_schema'"),
        ({"model": "tiny", "max_tokens": 4, "messages": TURNS,
          "output_config": {"format": {"type": "json_schema", "schema": True}}},
         "output_config.format.schema: Input should be a valid dictionary"),
        ({"model": "tiny", "max_tokens": 4, "messages": TURNS,
          "output_config": {"format": {"type": "json_schema"}}},
         "output_config.format.schema: Field required"),
        ({"model": "tiny", "max_tokens": 4, "messages": TURNS,
          "output_config": {"effort": "extreme"}}, "output_config.effort: Input should be"),
        ({"model": "tiny", "max_tokens": 4, "messages": TURNS, "output_format": FORMAT,
          "output_config": {"format": FORMAT}}, "`output_format` and `output_config.format`"),
        ({"model": "tiny", "max_tokens": 4, "messages": TURNS, "thinking": {"type": "enabled"}},
         "thinking.enabled.budget_tokens: Field required"),
        ({"model": "tiny", "max_tokens": 2048, "messages": TURNS,
          "thinking": {"type": "enabled", "budget_tokens": 512}},
         "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"),
        ({"model": "tiny", "max_tokens": 1024, "messages": TURNS,
          "thinking": {"type": "enabled", "budget_tokens": 1024}},
         "thinking.budget_tokens must be less than max_tokens"),
        ({"model": "tiny", "max_tokens": 4, "messages": TURNS, "thinking": {"type": "sometimes"}},
         "thinking: Input tag 'sometimes' found using 'type' does not match"),
    ],
)
def test_bad_input_is_an_invalid_request_error(
    client: anthropic.Anthropic, body: dict[str, Any], words: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.post("/v1/messages", cast_to=object, body=body)
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]
    assert_serving(client)


def test_unknown_models_and_oversized_bodies(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-adapter", max_tokens=2, messages=TURNS)
    assert missing.value.body == {"type": "error", "error": {
        "type": "not_found_error",
        "message": "The model `no-such-adapter` does not exist. Valid aliases: tiny."}}
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-adapter", messages=TURNS)
    with pytest.raises(anthropic.ContentTooLargeError) as large:
        client.messages.create(model="tiny", max_tokens=2, system="x" * (2 << 20), messages=TURNS)
    assert large.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
    assert_serving(client)
