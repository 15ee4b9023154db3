"""/v1/responses on the fake engine: objects and events as the OpenAI SDK parses them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from server.core.types import ChatPrompt
from server.engines.fake import FakeEngine
from tests.unit.test_openai_tools import CALL, TOOLS
from tests.unit.test_openai_translate import client_for, make_context

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # type: ignore[dict-item]


@pytest.fixture
async def http() -> AsyncIterator[tuple[httpx.AsyncClient, FakeEngine]]:
    fake = FakeEngine(model_name="tiny", tool_call_parser="hermes")
    async with await client_for(make_context(fake)) as client:
        yield client, fake


async def create(client: httpx.AsyncClient, **fields: Any) -> httpx.Response:
    return await client.post("/v1/responses", json={"max_output_tokens": 8, **fields})


def events_of(text: str) -> list[Any]:
    """Every event of a Responses stream, checked against its `event:` line."""
    events = []
    for block in text.strip().split("\n\n"):
        kind_line, data_line = block.split("\n")
        event = EVENTS.validate_json(data_line.removeprefix("data: "))
        assert kind_line == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


@pytest.mark.anyio
async def test_text_input_gives_a_message_and_usage(
    http: tuple[httpx.AsyncClient, FakeEngine],
) -> None:
    client, fake = http
    response = await create(client, input="hello there", instructions="be brief")
    assert response.status_code == 200, response.text
    body = Response.model_validate(response.json())
    assert body.id.startswith("resp_") and body.object == "response"
    assert body.status == "incomplete" and body.incomplete_details is not None  # 8 tokens ran out
    assert body.output_text.startswith("system: be brief user: hello")
    assert body.usage is not None and body.usage.output_tokens == 8
    assert list(response.json()) == [  # vLLM's fields, in its order
        "id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object",
        "output", "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p",
        "background", "max_output_tokens", "max_tool_calls", "previous_response_id", "prompt",
        "reasoning", "service_tier", "status", "text", "top_logprobs", "truncation", "usage",
        "user", "presence_penalty", "frequency_penalty", "kv_transfer_params",
        "ec_transfer_params", "input_messages", "output_messages",
    ]
    prompt = fake.requests[-1].prompt
    assert isinstance(prompt, ChatPrompt)
    assert [m.role for m in prompt.messages] == ["system", "user"]


@pytest.mark.anyio
async def test_stream_events_build_the_same_answer(
    http: tuple[httpx.AsyncClient, FakeEngine],
) -> None:
    client, _ = http
    whole = (await create(client, input="hello there")).json()
    streamed = await create(client, input="hello there", stream=True)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = events_of(streamed.text)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == whole["output"][0]["content"][0]["text"]
    assert final.usage.output_tokens == whole["usage"]["output_tokens"]


@pytest.mark.anyio
async def test_output_text_logprobs_when_included(
    http: tuple[httpx.AsyncClient, FakeEngine],
) -> None:
    """vLLM: `include: ["message.output_text.logprobs"]` puts the choice's logprobs on the
    message's text part and on each text delta; `top_logprobs` is echoed."""
    client, fake = http
    asked = {"input": "hello there", "include": ["message.output_text.logprobs"],
             "top_logprobs": 2}
    whole = await create(client, **asked)
    assert whole.status_code == 200, whole.text
    assert fake.requests[-1].output.logprobs == 2
    body = Response.model_validate(whole.json())
    part = body.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs is not None and len(part.logprobs) == 8
    assert "".join(lp.token for lp in part.logprobs) == part.text  # type: ignore[union-attr]
    assert whole.json()["top_logprobs"] == 2
    events = events_of((await create(client, **asked, stream=True)).text)
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in deltas] == [lp.token for lp in part.logprobs]
    done = next(e for e in events if e.type == "response.content_part.done")
    assert done.part.logprobs == part.logprobs
    plain = (await create(client, input="hello there")).json()
    assert plain["top_logprobs"] is None and plain["output"][0]["content"][0]["logprobs"] is None
    too_many = await create(client, **{**asked, "top_logprobs": 21})
    assert too_many.status_code == 400, too_many.text


@pytest.mark.anyio
async def test_vllm_sampling_extras_reach_the_engine(
    http: tuple[httpx.AsyncClient, FakeEngine],
) -> None:
    client, fake = http
    extras = {"ignore_eos": True, "stop_token_ids": [7], "include_stop_str_in_output": True,
              "skip_special_tokens": False, "logit_bias": {"5": 200}}
    assert (await create(client, input="hi", **extras)).status_code == 200
    sampling = fake.requests[-1].sampling
    assert (sampling.ignore_eos, sampling.stop_token_ids, sampling.include_stop_str_in_output,
            sampling.skip_special_tokens, sampling.logit_bias) == (True, (7,), True, False,
                                                                    ((5, 100.0),))


@pytest.mark.anyio
async def test_a_function_tool_round_trip(http: tuple[httpx.AsyncClient, FakeEngine]) -> None:
    client, fake = http
    first = await create(client, input=CALL, tools=FUNCTIONS, max_output_tokens=2)
    body = first.json()
    assert first.status_code == 200, body
    calls = [item for item in body["output"] if item["type"] == "function_call"]
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "paris"}')]
    assert calls[0]["id"].startswith("fc_") and calls[0]["status"] == "completed"
    follow = await create(
        client,
        previous_response_id=body["id"],
        input=[{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "sunny"}],
        tools=FUNCTIONS,
    )
    assert follow.status_code == 200, follow.text
    prompt = fake.requests[-1].prompt
    assert isinstance(prompt, ChatPrompt)
    roles = [m.role for m in prompt.messages]
    assert roles == ["user", "assistant", "tool"]
    assert prompt.messages[1].tool_calls[0].id == calls[0]["call_id"]  # the calls carry over
    assert prompt.messages[2].tool_call_id == calls[0]["call_id"]
    stored = await client.get(f"/v1/responses/{body['id']}")
    assert stored.status_code == 200 and stored.json() == body


@pytest.mark.anyio
async def test_streamed_function_call_events(http: tuple[httpx.AsyncClient, FakeEngine]) -> None:
    client, _ = http
    response = await create(
        client, input=CALL, tools=FUNCTIONS, tool_choice="required", stream=True,
        max_output_tokens=60,
    )
    events = events_of(response.text)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert done.arguments == arguments and json.loads(arguments)["city"]
    final = events[-1].response
    assert [item.type for item in final.output] == ["function_call"]
    assert final.output[0].arguments == arguments


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"input": 5}, 400, "body.input"),
        ({}, 400, "body.input"),
        ({"input": [{"type": "bogus"}]}, 400, "input.0.type"),
        ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
        ({"input": "x", "tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "nope"}},
         400, "tool_choice"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
        ({"input": "x", "prompt": {"id": "p"}}, 400, "prompt"),
        ({"input": "x", "previous_response_id": "resp_nope"}, 404, "response_id"),
        ({"input": "x", "model": "nope"}, 404, "model"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400,
         "input.0.content.0"),
    ],
)
async def test_bad_requests_answer_in_openai_shape(
    http: tuple[httpx.AsyncClient, FakeEngine], fields: dict[str, Any], status: int, param: str
) -> None:
    client, _ = http
    response = await client.post("/v1/responses", json=fields)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, status)
    assert (await create(client, input="again")).status_code == 200


@pytest.mark.anyio
async def test_unknown_ids_and_cancel(http: tuple[httpx.AsyncClient, FakeEngine]) -> None:
    client, _ = http
    missing = await client.get("/v1/responses/resp_nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "invalid_request_error"
    made = (await create(client, input="hi")).json()
    cancel = await client.post(f"/v1/responses/{made['id']}/cancel")
    assert cancel.status_code == 400
    assert cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
    unstored = (await create(client, input="hi", store=False)).json()
    assert (await client.get(f"/v1/responses/{unstored['id']}")).status_code == 404
