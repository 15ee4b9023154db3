"""Anthropic's Messages API on the fake engine: the translator (prompts, tools, sampling), the
non-streamed and streamed answers as the `anthropic` SDK reads them, count_tokens, and every
error class through the SDK's own exception types."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import anthropic
import httpx
import httpx2
import jsonschema
import pydantic
import pytest

from protocols.anthropic import schema, translate
from protocols.common.tools import ChoiceReader, ToolPlan
from server.core.errors import EngineError, InvalidRequest, Unsupported
from server.core.types import (
    ChatMessage,
    Delta,
    Done,
    FinishReason,
    ParsedOutput,
    Sampling,
    SamplingDefaults,
    Started,
    StructuredOutput,
    ToolCall,
    Usage,
)
from server.engines.fake import FakeScript
from server.gateway import Gateway
from server.http.context import RequestBounds
from tests.unit.gateway_kit import make_gateway

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "Weather", "input_schema": WEATHER},
    {"name": "noop", "input_schema": {"type": "object", "properties": {}}},
]
USER: list[Any] = [{"role": "user", "content": "hello there"}]
MOOD: dict[str, Any] = {
    "type": "object",
    "properties": {"mood": {"enum": ["good", "bad"]}, "sure": {"type": "boolean"}},
    "required": ["mood", "sure"],
    "additionalProperties": False,
}
FORMAT: Any = {"type": "json_schema", "schema": MOOD}


class Mood(pydantic.BaseModel):
    mood: Literal["good", "bad"]
    sure: bool


def body(**fields: Any) -> schema.MessagesRequest:
    return schema.MessagesRequest.model_validate(
        {"model": "tiny", "max_tokens": 8, "messages": USER, **fields}
    )


def sdk(gateway: Gateway, **headers: str) -> anthropic.AsyncAnthropic:
    transport = httpx2.ASGITransport(app=gateway.app(("data",)))
    return anthropic.AsyncAnthropic(
        api_key="sk-unit", base_url="http://gateway", max_retries=0,
        http_client=httpx2.AsyncClient(transport=transport, base_url="http://gateway"),
        default_headers=headers,
    )


def raw(gateway: Gateway) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=gateway.app(("data",)))
    return httpx.AsyncClient(transport=transport, base_url="http://gateway")


@pytest.fixture
async def client() -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with sdk(make_gateway()) as sdk_client:
        yield sdk_client


# ---- the translator ---------------------------------------------------------------------------


def test_system_blocks_and_turns_become_chat_messages() -> None:
    request = body(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "look it up", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris", "days": 1}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
    )
    prompt = translate.chat_prompt(request, ToolPlan())
    assert prompt.messages == (
        ChatMessage("system", "Be brief."),  # joined as vLLM joins them
        ChatMessage("user", "Weather?"),
        ChatMessage("assistant", "Let me look.", tool_calls=(ToolCall(
            id="toolu_1", name="get_weather", arguments='{"city":"Paris","days":1}'),),
            reasoning="look it up"),
        ChatMessage("tool", "sunny", tool_call_id="toolu_1"),  # results before the text
        ChatMessage("user", "And tomorrow?"),
    )
    assert prompt.add_generation_prompt and not prompt.continue_final_message


def test_a_final_assistant_turn_is_continued_and_thinking_sets_the_template() -> None:
    request = body(
        messages=[*USER, {"role": "assistant", "content": "The answer is"}],
        thinking={"type": "enabled", "budget_tokens": 2048},
    )
    prompt = translate.chat_prompt(request, ToolPlan())
    assert prompt.continue_final_message and not prompt.add_generation_prompt
    assert dict(prompt.chat_template_kwargs) == {"enable_thinking": True}
    disabled = translate.chat_prompt(body(thinking={"type": "disabled"}), ToolPlan())
    assert dict(disabled.chat_template_kwargs) == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("messages", "error", "param"),
    [
        ([{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}],
         Unsupported, "messages.0.content.0"),
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {}}]}]}], Unsupported, "messages.0.content.0.content.0"),
        ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                        "input": {}}]}], InvalidRequest, "messages.0.content.0"),
        ([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
         InvalidRequest, "messages.0.content.0"),
    ],
)
def test_media_and_misplaced_blocks_are_refused(
    messages: list[Any], error: type[Exception], param: str
) -> None:
    with pytest.raises(error) as caught:
        translate.chat_prompt(body(messages=messages), ToolPlan())
    assert getattr(caught.value, "param", None) == param


def test_tool_choice_maps_to_the_shared_plans() -> None:
    plan = translate.tool_plan(body(tools=TOOLS), tool_call_parser="hermes")
    assert plan.mode == "auto" and [f.name for f in plan.functions] == ["get_weather", "noop"]
    assert translate.tool_plan(body(tools=TOOLS), tool_call_parser=None).mode == "none"
    forced = translate.tool_plan(
        body(tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True}),
        tool_call_parser=None,
    )
    assert forced.mode == "required" and not forced.parallel
    named = translate.tool_plan(
        body(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}),
        tool_call_parser=None,
    )
    assert (named.mode, named.function) == ("named", "get_weather")
    structured = named.structured()
    assert structured is not None and structured.fit_budget
    assert translate.tool_plan(
        body(tools=TOOLS, tool_choice={"type": "none"}), tool_call_parser="hermes"
    ).mode == "none"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tools": [{"name": "f", "input_schema": {"type": "strng"}}]}, "tools.0.input_schema"),
    ],
)
def test_bad_tools_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        translate.tool_plan(body(**fields), tool_call_parser=None)
    assert caught.value.param == param


def test_sampling_takes_the_request_then_the_models_defaults() -> None:
    defaults = SamplingDefaults(temperature=0.6, top_p=0.9, repetition_penalty=1.1)
    given = translate.message_request(
        body(temperature=0.2, top_k=5, stop_sequences=["END"]), request_id="r",
        plan=ToolPlan(), bounds=RequestBounds(), defaults=defaults,
    )
    sampling = given.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.2, 0.9, 5)
    assert sampling.repetition_penalty == 1.1 and sampling.stop == ("END",)
    assert sampling.max_new_tokens == 8 and given.protocol == "anthropic"
    with pytest.raises(InvalidRequest) as caught:
        translate.message_request(
            body(stop_sequences=[""]), request_id="r", plan=ToolPlan(),
            bounds=RequestBounds(), defaults=defaults,
        )
    assert caught.value.param == "stop_sequences"


def sampling_of(**fields: Any) -> Sampling:
    request = body(**fields)
    return translate.message_request(
        request, request_id="r", plan=translate.tool_plan(request, tool_call_parser=None),
        bounds=RequestBounds(), defaults=SamplingDefaults(),
    ).sampling


@pytest.mark.parametrize(
    "fields",
    [
        {"output_config": {"format": FORMAT}},
        {"output_config": {"format": {"schema": MOOD}}},  # `type` left out, as vLLM takes it
        {"output_format": FORMAT},  # the beta's name
        {"output_format": FORMAT, "output_config": {"effort": "low"}},
        {"output_config": {"format": FORMAT}, "tools": TOOLS},  # tools called freely
    ],
)
def test_an_output_format_is_a_json_schema_constraint(fields: dict[str, Any]) -> None:
    assert sampling_of(**fields).structured == StructuredOutput(
        json_schema=json.dumps(MOOD, separators=(",", ":"))
    )


def test_a_forced_tool_call_wins_over_the_output_format() -> None:
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        forced = body(tools=TOOLS, tool_choice=choice)
        plan = translate.tool_plan(forced, tool_call_parser=None)
        given = sampling_of(tools=TOOLS, tool_choice=choice, output_config={"format": FORMAT})
        assert given.structured == plan.structured()
    assert sampling_of().structured is None
    assert sampling_of(output_config={"effort": "high"}).structured is None


def test_stop_sequences_end_text_but_never_cut_a_forced_calls_input() -> None:
    forced = {"tools": TOOLS, "tool_choice": {"type": "any"}}
    assert sampling_of(stop_sequences=["{"], **forced).stop == ()
    assert sampling_of(stop_sequences=["{"], tools=TOOLS).stop == ("{",)
    with pytest.raises(InvalidRequest):  # still checked
        sampling_of(stop_sequences=[""], **forced)


def test_both_output_formats_are_refused_naming_the_beta_one() -> None:
    with pytest.raises(InvalidRequest) as caught:
        sampling_of(output_format=FORMAT, output_config={"format": FORMAT})
    assert caught.value.param == "output_format"


def test_the_thinking_budget_bounds_reasoning_where_a_parser_can_find_it() -> None:
    """As vLLM's Messages API: `budget_tokens` is the engine's `thinking_token_budget`; without
    a reasoning parser the engine cannot bound reasoning (and vLLM would refuse the field), so
    the budget is only checked against `max_tokens`."""
    def budget(parser: str | None, max_tokens: int = 2048, **thinking: Any) -> int | None:
        request = body(max_tokens=max_tokens, thinking=thinking)
        return translate.message_request(
            request, request_id="r", plan=ToolPlan(), bounds=RequestBounds(),
            defaults=SamplingDefaults(), reasoning_parser=parser,
        ).sampling.thinking_token_budget

    assert budget("qwen3", type="enabled", budget_tokens=1024) == 1024
    assert budget(None, type="enabled", budget_tokens=1024) is None
    assert budget("qwen3", type="adaptive") is None
    assert budget("qwen3", type="disabled") is None
    for parser in ("qwen3", None):
        with pytest.raises(InvalidRequest) as caught:
            budget(parser, max_tokens=1024, type="enabled", budget_tokens=1024)
        assert caught.value.param == "thinking.budget_tokens"
    with pytest.raises(pydantic.ValidationError, match=r"thinking\.enabled\.budget_tokens"):
        body(thinking={"type": "enabled"})


def test_effort_is_the_templates_reasoning_effort() -> None:
    def kwargs(**fields: Any) -> dict[str, Any]:
        return dict(translate.chat_prompt(body(**fields), ToolPlan()).chat_template_kwargs)

    assert kwargs(output_config={"effort": "xhigh"}) == {
        "reasoning_effort": "xhigh", "enable_thinking": True}
    assert kwargs(output_config={"effort": "low"}, thinking={"type": "adaptive"}) == {
        "reasoning_effort": "low", "enable_thinking": True}
    # vLLM applies `thinking` after `output_config`: disabled thinking replaces the effort
    assert kwargs(output_config={"effort": "max"}, thinking={"type": "disabled"}) == {
        "enable_thinking": False}
    assert kwargs(output_config={"effort": "low"},
                  chat_template_kwargs={"enable_thinking": False}) == {
        "enable_thinking": False, "reasoning_effort": "low"}
    counted = schema.CountTokensRequest.model_validate(
        {"model": "tiny", "messages": USER, "output_config": {"effort": "medium",
                                                             "format": FORMAT}})
    assert dict(translate.chat_prompt(counted, ToolPlan()).chat_template_kwargs)[
        "reasoning_effort"] == "medium"


def test_strict_tools_reach_the_template_as_vllm_renders_them() -> None:
    strict = [{**TOOLS[0], "strict": True}, TOOLS[1]]
    rendered = json.loads(translate.tool_plan(body(tools=strict), tool_call_parser=None)
                          .tools_json or "")
    assert [tool["function"].get("strict") for tool in rendered] == [True, None]


# ---- answers through the SDK ------------------------------------------------------------------


async def test_a_message_and_its_stream_agree(client: anthropic.AsyncAnthropic) -> None:
    message = await client.messages.create(
        model="tiny", max_tokens=8, system="be nice", messages=USER
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.model == "tiny" and message.id.startswith("msg_")
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 8
    [block] = message.content
    assert block.type == "text" and block.text
    async with client.messages.stream(
        model="tiny", max_tokens=8, system="be nice", messages=USER
    ) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == block.text
    assert [(b.type, b.text) for b in final.content] == [("text", block.text)]  # type: ignore[union-attr]
    assert final.usage == message.usage
    assert final.stop_reason == message.stop_reason


async def test_the_stream_names_every_event(client: anthropic.AsyncAnthropic) -> None:
    gateway = make_gateway()
    async with raw(gateway) as http:
        response = await http.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 4, "stream": True, "messages": USER})
    assert response.headers["request-id"]
    frames = [f for f in response.text.split("\n\n") if f]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    for frame in frames:  # every data line follows its event line, and names the same type
        event, data = frame.split("\n")
        assert data.startswith("data: ") and f'"type":"{event[7:]}"' in data


async def test_a_stop_sequence_is_cut_and_named(client: anthropic.AsyncAnthropic) -> None:
    first = await client.messages.create(model="tiny", max_tokens=8, messages=USER)
    word = first.content[0].text.split()[2]  # type: ignore[union-attr]
    message = await client.messages.create(
        model="tiny", max_tokens=8, messages=USER, stop_sequences=[word]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert word not in message.content[0].text  # type: ignore[union-attr]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
async def test_forced_tool_calls_validate_streamed_or_not(
    client: anthropic.AsyncAnthropic, choice: Any
) -> None:
    message = await client.messages.create(
        model="tiny", max_tokens=40, messages=USER, tools=TOOLS, tool_choice=choice
    )
    assert message.stop_reason == "tool_use"
    calls = [b for b in message.content if b.type == "tool_use"]
    assert calls and all(b.type != "text" for b in message.content)
    for call in calls:
        if call.name == "get_weather":
            jsonschema.validate(call.input, WEATHER)
    async with client.messages.stream(
        model="tiny", max_tokens=40, messages=USER, tools=TOOLS, tool_choice=choice
    ) as stream:
        final = await stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (c.name, c.input) for c in calls
    ]
    assert final.stop_reason == "tool_use"


async def test_a_forced_call_cut_by_max_tokens_is_the_same_block_streamed_or_not(
    client: anthropic.AsyncAnthropic,
) -> None:
    """Anthropic answers an incomplete `tool_use` block under `max_tokens`; the stream shows
    the call as it starts, so the whole answer keeps it too (it had one empty text block)."""
    forced: dict[str, Any] = {"model": "tiny", "max_tokens": 14, "messages": USER,
                              "tools": TOOLS, "tool_choice": {"type": "any"}}
    message = await client.messages.create(**forced)
    async with client.messages.stream(**forced) as stream:
        final = await stream.get_final_message()
    assert message.stop_reason == final.stop_reason == "max_tokens"
    blocks = [(b.type, getattr(b, "name", None), getattr(b, "input", None))
              for b in message.content]
    assert blocks == [(b.type, getattr(b, "name", None), getattr(b, "input", None))
                      for b in final.content]
    assert blocks == [("tool_use", "get_weather", {"city": "text"})]  # read as far as it goes


async def test_an_output_format_answers_json_streamed_or_not(
    client: anthropic.AsyncAnthropic,
) -> None:
    parsed = await client.messages.parse(
        model="tiny", max_tokens=40, messages=USER, output_format=Mood
    )
    assert isinstance(parsed.parsed_output, Mood) and parsed.stop_reason == "end_turn"
    async with client.messages.stream(
        model="tiny", max_tokens=40, messages=USER, output_config={"format": FORMAT}
    ) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    jsonschema.validate(json.loads("".join(texts)), MOOD)
    assert [block.type for block in final.content] == ["text"]
    async with client.messages.stream(
        model="tiny", max_tokens=40, messages=USER, output_format=Mood
    ) as parsing:
        assert isinstance((await parsing.get_final_message()).parsed_output, Mood)


async def test_count_tokens_is_the_messages_input_tokens(
    client: anthropic.AsyncAnthropic,
) -> None:
    fields: dict[str, Any] = {"model": "tiny", "system": "be nice", "messages": USER,
                              "tools": TOOLS}
    outputs: list[dict[str, Any]] = [{}, {"output_config": {"effort": "low", "format": FORMAT}}]
    for output in outputs:
        counted = await client.messages.count_tokens(**fields, **output)
        message = await client.messages.create(max_tokens=2, **fields, **output)
        assert counted.input_tokens == message.usage.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.post("/v1/messages/count_tokens", cast_to=object, body={
            "model": "tiny", "messages": USER, "output_format": FORMAT,
            "output_config": {"format": FORMAT}})
    assert "output_format" in caught.value.message


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "'video'"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "text only"),
        ({"temperature": 3}, "temperature"),
        ({"messages": []}, "messages"),
        ({"output_config": {"format": {"type": "json_object", "schema": MOOD}}},
         "output_config.format.type: Input should be 'json_schema'"),
        ({"output_config": {"format": {"type": "json_schema"}}},
         "output_config.format.schema: Field required"),
        ({"output_config": {"format": {"type": "json_schema", "schema": "{}"}}},
         "output_config.format.schema: Input should be a valid dictionary"),
        ({"output_config": {"effort": "none"}}, "output_config.effort: Input should be 'low'"),
        ({"output_format": {"type": "json_schema", "schema": [MOOD]}}, "output_format.schema"),
        ({"output_format": FORMAT, "output_config": {"format": FORMAT}},
         "`output_format` and `output_config.format` cannot both be given"),
    ],
)
async def test_bad_input_is_an_invalid_request_error(
    client: anthropic.AsyncAnthropic, fields: dict[str, Any], words: str
) -> None:
    request: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "messages": USER, **fields}
    request = {k: v for k, v in request.items() if v is not None}
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.post("/v1/messages", cast_to=object, body=request)
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "error"  # type: ignore[index]
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert words in caught.value.message
    message = await client.messages.create(model="tiny", max_tokens=2, messages=USER)
    assert message.usage.output_tokens == 2  # the engine serves on


async def test_each_error_class_reaches_the_sdks_exception_type() -> None:
    async with sdk(make_gateway()) as client:
        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.messages.create(model="nope", max_tokens=2, messages=USER)
        assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    small = make_gateway(overrides={"ServerConfig": {"maxRequestLength": 1}})  # 1 MiB
    async with sdk(small) as client:
        with pytest.raises(anthropic.ContentTooLargeError) as large:
            await client.messages.create(
                model="tiny", max_tokens=2, messages=USER, system="x" * (1 << 20)
            )
        assert large.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
    failing = make_gateway(FakeScript(reject_with=EngineError("scripted failure")))
    async with sdk(failing) as client:
        with pytest.raises(anthropic.InternalServerError) as internal:
            await client.messages.create(model="tiny", max_tokens=2, messages=USER)
        assert internal.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    draining = make_gateway()
    draining.lifecycle.begin_drain()
    async with sdk(draining) as client:
        with pytest.raises(anthropic.OverloadedError) as overloaded:
            await client.messages.create(model="tiny", max_tokens=2, messages=USER)
        assert overloaded.value.status_code == 529
        assert overloaded.value.response.headers["retry-after"]


async def test_a_full_queue_is_a_rate_limit_error() -> None:
    gateway = make_gateway(overrides={
        "LimitsConfig": {"maxConcurrentRequests": 1, "maxQueue": 0}})
    await gateway.service.admission.acquire(1, "")  # the one slot is taken
    async with sdk(gateway) as client:
        with pytest.raises(anthropic.RateLimitError) as caught:
            await client.messages.create(model="tiny", max_tokens=2, messages=USER)
    assert caught.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert caught.value.response.headers["retry-after"]
    gateway.service.admission.release()


async def test_an_error_after_the_first_byte_is_an_error_event() -> None:
    gateway = make_gateway(FakeScript(fail_after=2))
    async with sdk(gateway) as client:
        with pytest.raises(anthropic.APIStatusError) as caught:
            async with client.messages.stream(model="tiny", max_tokens=8, messages=USER) as s:
                await s.get_final_message()
    assert caught.value.body["error"]["type"] == "api_error"  # type: ignore[index]


@pytest.mark.parametrize("header", ["x-api-key", "authorization"])
async def test_keys_come_as_x_api_key_or_bearer(header: str) -> None:
    gateway = make_gateway(overrides={"SecurityConfig": {"apiKeys": ["sk-right"]}})
    value = "sk-right" if header == "x-api-key" else "Bearer sk-right"
    async with raw(gateway) as http:
        refused = await http.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 2, "messages": USER})
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        answered = await http.post(
            "/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": USER},
            headers={header: value, "anthropic-version": "2023-06-01",
                     "anthropic-beta": "tools-2024-04-04"},
        )
        assert answered.status_code == 200, answered.text
    async with sdk(gateway) as client:
        with pytest.raises(anthropic.AuthenticationError):
            await client.messages.create(model="tiny", max_tokens=2, messages=USER)


async def test_metrics_count_the_protocol_by_name() -> None:
    gateway = make_gateway()
    async with raw(gateway) as http:
        await http.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": USER})
        await http.post("/v1/messages/count_tokens", json={"model": "nope", "messages": USER})
    registry = gateway.metrics.registry
    http_name = "gateway_http_requests_total"
    assert registry.get_sample_value(
        http_name, {"protocol": "anthropic", "endpoint": "/v1/messages", "status": "200"}
    ) == 1
    assert registry.get_sample_value(
        http_name,
        {"protocol": "anthropic", "endpoint": "/v1/messages/count_tokens", "status": "404"},
    ) == 1
    generations = [
        s for family in registry.collect() for s in family.samples
        if s.name.startswith("gateway_generation_requests") and s.value
    ]
    assert {s.labels.get("protocol") for s in generations} == {"anthropic"}


class _TextParser:
    """A parser that reads every piece as content: what no parser does, through the parser
    path (so the stream takes the general route)."""

    def parse(
        self, text: str, token_ids: Sequence[int], *, prompt_token_ids: Sequence[int] = ()
    ) -> ParsedOutput:
        return ParsedOutput(content=text)

    def parse_delta(
        self, text: str, token_ids: Sequence[int], *,
        prompt_token_ids: Sequence[int] | None, finished: bool,
    ) -> ParsedOutput | None:
        return ParsedOutput(content=text) if text else None


@pytest.mark.parametrize("finish", [FinishReason.LENGTH, FinishReason.STOP])
def test_text_deltas_written_from_the_template_are_the_general_events(
    finish: FinishReason,
) -> None:
    view = translate.ReplyView(id="msg_1", model="tiny")
    plain = translate.MessageStreamEncoder(view, ChoiceReader(ToolPlan(), None))
    general = translate.MessageStreamEncoder(view, ChoiceReader(ToolPlan(), _TextParser()))
    events = [
        Started(prompt_token_ids=(1, 2)),
        Delta(choice=0, text="Hi", token_ids=(3,)),
        Delta(choice=0, text="", token_ids=(4,)),  # a character not complete yet
        Delta(choice=0, text=' "you" é😀', token_ids=(5,)),
        Delta(choice=0, text="!", token_ids=(6,), finish=finish),
        Done(usage=Usage(prompt_tokens=2, completion_tokens=4)),
    ]
    assert [plain.encode(e) for e in events] == [general.encode(e) for e in events]


def test_an_empty_answer_still_gets_its_text_block_from_the_template_path() -> None:
    view = translate.ReplyView(id="msg_1", model="tiny")
    plain = translate.MessageStreamEncoder(view, ChoiceReader(ToolPlan(), None))
    general = translate.MessageStreamEncoder(view, ChoiceReader(ToolPlan(), _TextParser()))
    events = [
        Started(prompt_token_ids=(1,)),
        Delta(choice=0, text="", token_ids=(), finish=FinishReason.STOP),
        Done(usage=Usage(prompt_tokens=1, completion_tokens=0)),
    ]
    assert [plain.encode(e) for e in events] == [general.encode(e) for e in events]
