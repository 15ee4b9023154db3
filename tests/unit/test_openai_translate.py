"""OpenAI protocol: translators, encoders and error table (pure), plus the routes in process on
the fake engine. Shapes are checked against PROTOCOLS.md §2 and parsed with the openai SDK's own
models, so whatever vLLM clients read, they can read from us."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from protocols.common.chat import response_model
from protocols.openai_v1 import errors, routes, schema
from protocols.openai_v1.chat_replies import ChatStreamEncoder, ChatView, chat_response
from protocols.openai_v1.completion_replies import (
    CompletionStreamEncoder,
    CompletionView,
    completion_response,
)
from protocols.openai_v1.models import model_list
from protocols.openai_v1.replies import ChunkWriter, ReplyMeta, StreamUsage
from protocols.openai_v1.requests import chat_request, completion_requests
from protocols.openai_v1.structured import to_structured
from server import __version__
from server.core.adapter_files import AdapterRules
from server.core.adapters import AdapterLimits, AdapterRegistry
from server.core.errors import (
    AdapterExists,
    AdapterInvalid,
    AdapterSourceMissing,
    ContextLengthExceeded,
    DeadlineExceeded,
    EngineError,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    ServiceUnavailable,
    Unsupported,
)
from server.core.lifecycle import Lifecycle
from server.core.service import InferenceService, Limits
from server.core.types import (
    ChatPrompt,
    Choice,
    Delta,
    Done,
    FinishReason,
    GenerationEvent,
    GenerationResult,
    Started,
    StructuredOutput,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
    TopLogprob,
    Usage,
)
from server.engines.fake import FakeEngine, FakeScript
from server.http.context import ProtocolContext, RequestBounds
from tests.unit.demo_kit import write_adapter
from tests.unit.gateway_kit import client as gateway_client
from tests.unit.gateway_kit import make_gateway, routes_app

BOUNDS = RequestBounds(max_n=4, max_stop_sequences=2, max_logprobs=5, max_prompts=3)
META = ReplyMeta(id="chatcmpl-abc", created=1730000000, model="a1")
CMPL_META = ReplyMeta(id="cmpl-abc", created=1730000000, model="tiny")


def chat_body(**fields: Any) -> schema.ChatCompletionRequest:
    data = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return schema.ChatCompletionRequest.model_validate(data)


def completion_body(**fields: Any) -> schema.CompletionRequest:
    return schema.CompletionRequest.model_validate({"prompt": "one two", **fields})


def sse_payloads(data: bytes) -> list[Any]:
    """Split SSE bytes into decoded `data:` payloads ("[DONE]" stays a string)."""
    assert data.endswith(b"\n\n")
    payloads = []
    for event in data.decode().split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        body = event.removeprefix("data: ")
        payloads.append(body if body == "[DONE]" else json.loads(body))
    return payloads


def events_of(*events: GenerationEvent) -> list[GenerationEvent]:
    return list(events)


# ---- inbound ------------------------------------------------------------------------------------


def test_chat_defaults_follow_vllm() -> None:
    gen = chat_request(chat_body(), request_id="r1", bounds=BOUNDS)
    assert gen.request_id == "r1"
    assert gen.model == ""
    assert gen.sampling.max_new_tokens is None  # remaining context
    assert gen.sampling.temperature == 1.0
    assert gen.sampling.top_k == 0
    assert gen.output.logprobs is None
    assert isinstance(gen.prompt, ChatPrompt)
    assert gen.prompt.add_generation_prompt is True


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    gen = chat_request(
        chat_body(max_tokens=7, max_completion_tokens=3), request_id="r", bounds=BOUNDS
    )
    assert gen.sampling.max_new_tokens == 3


@pytest.mark.parametrize(("sent", "kept"), [(None, None), (-1, None), (0, 0), (5, 5)])
def test_thinking_token_budget_minus_one_is_unlimited(sent: int | None, kept: int | None) -> None:
    extra = {} if sent is None else {"thinking_token_budget": sent}
    gen = chat_request(chat_body(**extra), request_id="r", bounds=BOUNDS)
    assert gen.sampling.thinking_token_budget == kept


@pytest.mark.parametrize("sent", [-2, 1.5, True, "3"])
def test_thinking_token_budget_is_a_whole_number_from_minus_one(sent: object) -> None:
    with pytest.raises(ValidationError):
        chat_body(thinking_token_budget=sent)


def test_chat_vllm_extras_reach_sampling() -> None:
    body = chat_body(
        model="a1",
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        ignore_eos=True,
        min_tokens=2,
        stop_token_ids=[3],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        allowed_token_ids=[1, 2],
        bad_words=["x"],
        thinking_token_budget=16,
        truncate_prompt_tokens=8,
        seed=7,
        priority=3,
        stop="END",
        logit_bias={"5": 250.0},
    )
    gen = chat_request(body, request_id="r", bounds=BOUNDS)
    s = gen.sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.min_new_tokens) == (5, 0.1, 1.2, 2)
    assert s.ignore_eos and s.include_stop_str_in_output and not s.skip_special_tokens
    assert s.stop == ("END",)
    assert s.stop_token_ids == (3,)
    assert s.allowed_token_ids == (1, 2)
    assert s.bad_words == ("x",)
    assert s.thinking_token_budget == 16
    assert s.truncate_prompt_tokens == 8
    assert s.seed == 7
    assert s.logit_bias == ((5, 100.0),)  # clamped like vLLM
    assert gen.priority == 3
    assert gen.model == "a1"


def test_chat_text_parts_are_joined_and_images_refused() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    gen = chat_request(
        chat_body(messages=[{"role": "user", "content": parts}]), request_id="r", bounds=BOUNDS
    )
    assert isinstance(gen.prompt, ChatPrompt)
    assert gen.prompt.messages[0].content == "a\nb"
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    with pytest.raises(Unsupported) as info:
        chat_request(
            chat_body(messages=[{"role": "user", "content": image}]), request_id="r", bounds=BOUNDS
        )
    assert info.value.param == "messages.0.content"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 5}, "n"),
        ({"stop": ["a", "b", "c"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"chat_template": "{{ 1 }}"}, "chat_template"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs.chat_template"),
        ({"chat_template_kwargs": {"nested": {"a": 1}}}, "chat_template_kwargs.nested"),
        ({"chat_template_kwargs": {"items": [1]}}, "chat_template_kwargs.items"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"use_beam_search": True, "n": 3}, "logprobs"),  # each step would ask 6 of at most 5
    ],
)
def test_chat_refusals_name_the_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        chat_request(chat_body(**fields), request_id="r", bounds=BOUNDS)
    assert info.value.param == param


def test_chat_template_kwargs_scalars_pass() -> None:
    kwargs = {"enable_thinking": False, "name": "x", "level": 2, "nothing": None}
    gen = chat_request(
        chat_body(chat_template_kwargs=kwargs), request_id="r", bounds=BOUNDS
    )
    assert isinstance(gen.prompt, ChatPrompt)
    assert dict(gen.prompt.chat_template_kwargs) == kwargs


def test_continue_final_message_excludes_generation_prompt() -> None:
    with pytest.raises(InvalidRequest):
        chat_request(
            chat_body(continue_final_message=True), request_id="r", bounds=BOUNDS
        )
    gen = chat_request(
        chat_body(continue_final_message=True, add_generation_prompt=False),
        request_id="r",
        bounds=BOUNDS,
    )
    assert isinstance(gen.prompt, ChatPrompt)
    assert gen.prompt.continue_final_message


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("one two", [TextPrompt("one two")]),
        (["a", "b"], [TextPrompt("a"), TextPrompt("b")]),
        ([1, 2, 3], [TokenPrompt((1, 2, 3))]),
        ([[1, 2], [3]], [TokenPrompt((1, 2)), TokenPrompt((3,))]),
    ],
)
def test_completion_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    gens = completion_requests(
        completion_body(prompt=prompt), request_id="r", bounds=BOUNDS
    )
    assert [g.prompt for g in gens] == expected
    assert all(g.request_id == "r" for g in gens)


def test_completion_max_tokens_defaults_to_16_also_when_null() -> None:
    for body in (completion_body(), completion_body(max_tokens=None)):
        (gen,) = completion_requests(body, request_id="r", bounds=BOUNDS)
        assert gen.sampling.max_new_tokens == 16


def test_completion_echo_with_logprobs_asks_prompt_logprobs() -> None:
    (gen,) = completion_requests(
        completion_body(echo=True, logprobs=2), request_id="r", bounds=BOUNDS
    )
    assert (gen.output.logprobs, gen.output.prompt_logprobs) == (2, 2)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": None}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b", "c", "d"]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"logprobs": 6}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"suffix": "x"}, "suffix"),
        ({"n": 9}, "n"),
    ],
)
def test_completion_refusals_name_the_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        completion_requests(completion_body(**fields), request_id="r", bounds=BOUNDS)
    assert info.value.param == param


def test_response_model_echoes_adapter_and_maps_base_aliases() -> None:
    assert response_model("a1", {"tiny", "tiny-alias"}, "tiny") == "a1"
    assert response_model("tiny-alias", {"tiny", "tiny-alias"}, "tiny") == "tiny"
    assert response_model("", {"tiny"}, "tiny") == "tiny"


# ---- outbound: chat -----------------------------------------------------------------------------


def chat_events(n: int = 1) -> list[GenerationEvent]:
    events: list[GenerationEvent] = [Started(prompt_token_ids=(1, 2, 3))]
    for i in range(n):
        events += [
            Delta(choice=i, text="Hel", token_ids=(10,)),
            Delta(
                choice=i, text="lo", token_ids=(11,), finish=FinishReason.STOP, matched_stop="\n"
            ),
        ]
    events.append(Done(usage=Usage(prompt_tokens=3, completion_tokens=2 * n)))
    return events


def encode_all(encoder: Any, events: list[Any]) -> list[Any]:
    return sse_payloads(b"".join(encoder.encode(e) for e in events))


def test_chat_stream_matches_vllm_chunk_sequence() -> None:
    """Chunk for chunk what vLLM 0.32's own server sent for the same request (captured)."""
    view = ChatView(meta=META, usage=StreamUsage(include=True))
    chunks = encode_all(ChatStreamEncoder(view), chat_events())
    head = {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 1730000000,
        "model": "a1",
    }
    assert chunks == [
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "prompt_token_ids": None,
            "prompt_text": None,
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "Hel"},
                    "logprobs": None,
                    "finish_reason": None,
                    "token_ids": None,
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "lo"},
                    "logprobs": None,
                    "finish_reason": "stop",
                    "stop_reason": "\n",
                    "token_ids": None,
                }
            ],
        },
        {
            **head,
            "choices": [],
            "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2},
        },
    ]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)


def test_chat_stream_lone_end_is_an_empty_finish_chunk() -> None:
    events = [
        Started(prompt_token_ids=(1,)),
        Delta(choice=0, text="lo", token_ids=(11,)),
        Delta(choice=0, text="", finish=FinishReason.STOP, matched_stop="\n"),
    ]
    chunks = encode_all(ChatStreamEncoder(ChatView(meta=META)), events)
    assert chunks[-1]["choices"] == [
        {
            "index": 0,
            "delta": {"content": ""},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": "\n",
            "token_ids": None,
        }
    ]


def test_chat_stream_without_include_usage_has_no_usage_chunk() -> None:
    chunks = encode_all(ChatStreamEncoder(ChatView(meta=META)), chat_events())
    assert len(chunks) == 3  # role, "Hel", "lo" with its finish
    assert all(c["choices"] for c in chunks)


def test_chat_stream_continuous_usage_counts_per_choice() -> None:
    view = ChatView(
        meta=META, n=2, usage=StreamUsage(include=True, continuous=True)
    )
    chunks = encode_all(ChatStreamEncoder(view), chat_events(n=2))
    role_chunks = chunks[:2]
    assert [c["choices"][0]["index"] for c in role_chunks] == [0, 1]
    assert all(c["usage"]["completion_tokens"] == 0 for c in role_chunks)
    second = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == 1]
    assert [c["usage"]["completion_tokens"] for c in second] == [0, 1, 2]
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4}


def test_chat_stream_logprobs_and_echo() -> None:
    lp = TokenLogprob(
        token_id=10,
        token="Hel",
        logprob=-0.5,
        top=(
            TopLogprob(token_id=10, token="Hel", logprob=-0.5),
            TopLogprob(token_id=12, token="He", logprob=float("-inf")),
        ),
    )
    view = ChatView(meta=META, logprobs=True, echo_prefix="Sure: ")
    encoder = ChatStreamEncoder(view)
    chunks = encode_all(
        encoder,
        [
            Started(prompt_token_ids=(1,)),
            Delta(choice=0, text="Hel", token_ids=(10,), logprobs=(lp,)),
        ],
    )
    assert chunks[1]["choices"][0]["delta"] == {"content": "Sure: "}
    content = chunks[2]["choices"][0]["logprobs"]["content"]
    assert content == [
        {
            "token": "Hel",
            "logprob": -0.5,
            "bytes": [72, 101, 108],
            "top_logprobs": [
                {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
                {"token": "He", "logprob": -9999.0, "bytes": [72, 101]},
            ],
        }
    ]


def chat_result(n: int = 1) -> GenerationResult:
    choices = tuple(
        Choice(index=i, text="Hello", finish_reason=FinishReason.LENGTH, token_ids=(10, 11))
        for i in range(n)
    )
    return GenerationResult(
        request_id="abc",
        model="a1",
        prompts=(Started(prompt_token_ids=(1, 2, 3)),),
        choices=choices,
        usage=Usage(prompt_tokens=3, completion_tokens=2 * n),
    )


def test_chat_response_has_every_vllm_field() -> None:
    body = chat_response(chat_result(), ChatView(meta=META))
    assert body == {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "created": 1730000000,
        "model": "a1",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hello",
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": 3,
            "total_tokens": 5,
            "completion_tokens": 2,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "kv_transfer_params": None,
    }
    ChatCompletion.model_validate(body)


def test_chat_echo_prefixes_last_assistant_message() -> None:
    body = chat_body(
        echo=True,
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "A: "}],
    )
    view = ChatView.of(body, META)
    response = chat_response(chat_result(), view)
    assert response["choices"][0]["message"]["content"] == "A: Hello"
    assert ChatView.of(chat_body(echo=True), META).echo_prefix == ""


# ---- outbound: completions --------------------------------------------------------------------


def test_completion_response_has_every_vllm_field() -> None:
    result = GenerationResult(
        request_id="abc",
        model="tiny",
        prompts=(Started(prompt_token_ids=(1,)),),
        choices=(Choice(index=0, text=" x", finish_reason=FinishReason.STOP, matched_stop=2),),
        usage=Usage(prompt_tokens=1, completion_tokens=1),
    )
    body = completion_response(result, CompletionView(meta=CMPL_META))
    assert body == {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 1730000000,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": " x",
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": 2,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": 1,
            "total_tokens": 2,
            "completion_tokens": 1,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "kv_transfer_params": None,
    }
    Completion.model_validate(body)


def lp(token: str, value: float, token_id: int = 0) -> TokenLogprob:
    return TokenLogprob(
        token_id=token_id,
        token=token,
        logprob=value,
        top=(TopLogprob(token_id=99, token="zz", logprob=-3.0),),
    )


def test_completion_echo_logprobs_cover_prompt_then_output() -> None:
    started = Started(
        prompt_token_ids=(5, 6), prompt_text="ab", prompt_logprobs=(None, lp("b", -1.0, 6))
    )
    result = GenerationResult(
        request_id="abc",
        model="tiny",
        prompts=(started,),
        choices=(
            Choice(
                index=0, text="cd", finish_reason=FinishReason.LENGTH, logprobs=(lp("cd", -0.25),)
            ),
        ),
        usage=Usage(prompt_tokens=2, completion_tokens=1),
    )
    view = CompletionView(
        meta=CMPL_META,
        logprobs=1,
        echo=True,
        echo_texts=("ab",),
        token_texts=lambda ids: [f"<{i}>" for i in ids],
    )
    choice = completion_response(result, view)["choices"][0]
    assert choice["text"] == "abcd"
    assert choice["logprobs"] == {
        "text_offset": [0, 3, 4],
        "token_logprobs": [None, -1.0, -0.25],
        "tokens": ["<5>", "b", "cd"],
        "top_logprobs": [None, {"b": -1.0, "zz": -3.0}, {"cd": -0.25, "zz": -3.0}],
    }


def test_completion_stream_echoes_once_per_choice_and_tracks_offsets() -> None:
    view = CompletionView(
        meta=CMPL_META,
        n=1,
        echo=True,
        logprobs=0,
        echo_texts=("p0", "p1"),
        usage=StreamUsage(include=True),
    )
    items: list[GenerationEvent] = [
        Started(prompt_token_ids=(1, 2)),
        Delta(choice=0, text="x", token_ids=(3,), logprobs=(lp("x", -1.0),)),
        Delta(choice=1, text="y", token_ids=(4,), logprobs=(lp("y", -1.0),)),
        Delta(
            choice=0, text="z", token_ids=(5,), logprobs=(lp("z", -1.0),),
            finish=FinishReason.LENGTH,
        ),
        Delta(choice=1, text="", finish=FinishReason.STOP, matched_stop=2),
        Done(usage=Usage(prompt_tokens=4, completion_tokens=3)),
    ]
    chunks = encode_all(CompletionStreamEncoder(view), items)
    texts = [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks if c["choices"]]
    assert texts == [(0, "p0x"), (1, "p1y"), (0, "z"), (1, "")]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [1, 2]  # vLLM: with the echo
    assert chunks[1]["choices"][0]["prompt_token_ids"] is None  # no Started for prompt 1 here
    # offsets are per choice; prompt 1's own rows are unknown without its Started: past it
    assert chunks[1]["choices"][0]["logprobs"]["text_offset"] == [2]
    assert chunks[2]["choices"][0]["logprobs"]["text_offset"] == [1]
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["choices"][0] == {
        "index": 1,
        "text": "",
        "logprobs": {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []},
        "finish_reason": "stop",
        "stop_reason": 2,
        "prompt_token_ids": None,
        "token_ids": None,
    }
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}
    for chunk in chunks:  # (the SDK's own model rejects vLLM's null finish_reason in chunks)
        assert chunk["object"] == "text_completion"


def test_completion_stream_of_a_batch_echoes_each_prompt_from_its_own_started() -> None:
    view = CompletionView(
        meta=CMPL_META, n=1, echo=True, return_token_ids=True,
        usage=StreamUsage(include=True, continuous=True),
    )
    items: list[GenerationEvent] = [
        Started(prompt_token_ids=(1, 2), prompt_text="p0"),
        Started(prompt_token_ids=(7,), prompt_text="p1", prompt_index=1),
        Delta(choice=1, text="y", token_ids=(4,), finish=FinishReason.LENGTH),
        Delta(choice=0, text="x", token_ids=(3,), finish=FinishReason.LENGTH),
        Done(usage=Usage(prompt_tokens=3, completion_tokens=2)),
    ]
    chunks = encode_all(CompletionStreamEncoder(view), items)
    by_choice = {c["choices"][0]["index"]: c for c in chunks if c["choices"]}
    assert by_choice[0]["choices"][0]["text"] == "p0x"
    assert by_choice[1]["choices"][0]["text"] == "p1y"
    assert by_choice[0]["choices"][0]["prompt_token_ids"] == [1, 2]
    assert by_choice[1]["choices"][0]["prompt_token_ids"] == [7]
    # continuous usage counts each prompt's own tokens, known from its Started (no re-tokenizing)
    assert by_choice[1]["usage"]["prompt_tokens"] == 1
    assert by_choice[0]["usage"]["prompt_tokens"] == 2


def test_completion_stream_chunks_carry_vllms_fields() -> None:
    """Chunk for chunk what vLLM 0.32's own server sent (captured), usage chunk included."""
    view = CompletionView(meta=CMPL_META, usage=StreamUsage(include=True))
    items: list[GenerationEvent] = [
        Started(prompt_token_ids=(1,)),
        Delta(choice=0, text=" 7", token_ids=(3,)),
        Delta(choice=0, text="ello", token_ids=(4,), finish=FinishReason.LENGTH),
        Done(usage=Usage(prompt_tokens=1, completion_tokens=2)),
    ]
    head = {"id": "cmpl-abc", "object": "text_completion", "created": 1730000000, "model": "tiny"}
    none = {"prompt_token_ids": None, "token_ids": None}
    assert encode_all(CompletionStreamEncoder(view), items) == [
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "text": " 7",
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                    **none,
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "text": "ello",
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    **none,
                }
            ],
        },
        {
            **head,
            "choices": [],
            "usage": {"prompt_tokens": 1, "total_tokens": 3, "completion_tokens": 2},
        },
    ]


TGI_META = ReplyMeta(id="chatcmpl-abc", created=1730000000, model="tiny",
                     fingerprint="0.1.0-native", fingerprint_each_chunk=True)
VLLM_META = replace(META, fingerprint="vllm-0.32.0-1a2b3c4d")


def test_chunks_for_model_tgi_carry_its_fingerprint_after_model_as_tgis_router() -> None:
    """router/src/lib.rs `ChatCompletionChunk` and `Chunk` (completions): `system_fingerprint`
    on every chunk, the usage chunk included; vLLM's chunks (other names) carry none."""
    view = ChatView(meta=TGI_META, usage=StreamUsage(include=True))
    raw = b"".join(ChatStreamEncoder(view).encode(e) for e in chat_events())
    chunks = sse_payloads(raw)
    assert len(chunks) == 4
    assert all(c["system_fingerprint"] == "0.1.0-native" for c in chunks)
    assert raw.count(b'"model":"tiny","system_fingerprint":"0.1.0-native","choices":[') == 4
    cmpl = CompletionView(meta=replace(TGI_META, id="cmpl-abc"), usage=StreamUsage(include=True))
    items = [Started(prompt_token_ids=(1,)), Delta(choice=0, text="x", token_ids=(3,)),
             Delta(choice=0, text="y", token_ids=(4,), finish=FinishReason.LENGTH),
             Done(usage=Usage(prompt_tokens=1, completion_tokens=2))]
    completions = encode_all(CompletionStreamEncoder(cmpl), items)
    assert [c["system_fingerprint"] for c in completions] == ["0.1.0-native"] * 3
    plain = encode_all(ChatStreamEncoder(ChatView(meta=META)), chat_events())
    assert not any("system_fingerprint" in c for c in plain)


def test_vllm_stamps_its_fingerprint_on_the_streams_last_message_only() -> None:
    """vLLM 0.32 (chat_completion/serving.py, completion/serving.py): a choice's finishing chunk
    carries `system_fingerprint` after its fields when no usage chunk follows; with
    `include_usage` only the usage chunk does."""
    stamp = b',"system_fingerprint":"vllm-0.32.0-1a2b3c4d"}'
    for usage in (StreamUsage(), StreamUsage(include=True)):
        raw = b"".join(ChatStreamEncoder(ChatView(meta=VLLM_META, usage=usage)).encode(e)
                       for e in chat_events())
        chunks = sse_payloads(raw)
        stamped = [c for c in chunks if "system_fingerprint" in c]
        assert stamped == [chunks[-1]] and raw.count(stamp) == 1
        assert chunks[-1]["system_fingerprint"] == "vllm-0.32.0-1a2b3c4d"
        assert (chunks[-1]["choices"] == []) is usage.include
    items = [Started(prompt_token_ids=(1,)),
             Delta(choice=0, text="x", token_ids=(3,)),
             Delta(choice=1, text="y", token_ids=(4,), finish=FinishReason.LENGTH),
             Delta(choice=0, text="z", token_ids=(5,), finish=FinishReason.STOP)]
    cmpl = CompletionView(meta=replace(VLLM_META, id="cmpl-abc"), n=2)
    completions = encode_all(CompletionStreamEncoder(cmpl), items)
    assert ["system_fingerprint" in c for c in completions] == [False, True, True]


@pytest.mark.anyio
async def test_the_gateway_streams_tgis_fingerprint_for_model_tgi_only() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    async with gateway_client(make_gateway(), "data") as http:
        whole = await http.post("/v1/chat/completions", json={**body, "model": "tgi",
                                                               "stream": False})
        tgi = await http.post("/v1/chat/completions", json={**body, "model": "tgi"})
        tiny = await http.post("/v1/chat/completions", json={**body, "model": "tiny"})
    fingerprint = whole.json()["system_fingerprint"]
    assert fingerprint == f"{__version__}-native"
    *chunks, done = sse_payloads(tgi.content)
    assert done == "[DONE]" and len(chunks) >= 2
    assert all(chunk["system_fingerprint"] == fingerprint for chunk in chunks)
    assert not any("system_fingerprint" in chunk for chunk in sse_payloads(tiny.content)[:-1])


def test_completion_echo_without_generation_returns_prompt_only() -> None:
    body = completion_body(echo=True, max_tokens=0)
    view = CompletionView.of(
        body, CMPL_META, prompts=[TextPrompt("one two")], token_texts=lambda ids: []
    )
    result = GenerationResult(
        request_id="r",
        model="tiny",
        prompts=(Started(prompt_token_ids=(1, 2)),),
        choices=(Choice(index=0, text="more", finish_reason=FinishReason.LENGTH),),
        usage=Usage(prompt_tokens=2, completion_tokens=1),
    )
    assert completion_response(result, view)["choices"][0]["text"] == "one two"


# ---- models, errors -----------------------------------------------------------------------------


def test_model_list_shows_lineage_without_paths() -> None:
    body = model_list(["tiny"], ["a1"], created=5, max_model_len=512)
    base, adapter = body["data"]
    assert (base["id"], base["root"], base["parent"], base["max_model_len"]) == (
        "tiny",
        "tiny",
        None,
        512,
    )
    assert (adapter["id"], adapter["parent"], adapter["max_model_len"]) == ("a1", "tiny", None)
    assert base["permission"][0]["object"] == "model_permission"
    assert set(base) == {
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    }


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (InvalidRequest("x", param="n"), 400, "BadRequestError"),
        (ContextLengthExceeded("x"), 400, "BadRequestError"),
        (AdapterInvalid("x"), 400, "BadRequestError"),
        (errors.InvalidUserInput("x"), 400, "InvalidUserInput"),
        (AdapterExists("x"), 400, "InvalidUserInput"),
        (ModelNotFound("x"), 404, "NotFoundError"),
        (errors.LoraPathNotFound("x"), 404, "NotFoundError"),
        (Overloaded(), 429, "RateLimitError"),
        (EngineError("x"), 500, "InternalServerError"),
        (GatewayError("x"), 500, "InternalServerError"),
        (ServiceUnavailable("x"), 503, "ServiceUnavailableError"),
        (DeadlineExceeded("x"), 504, "TimeoutError"),
    ],
)
def test_error_table(exc: GatewayError, status: int, kind: str) -> None:
    response = errors.render(exc)
    assert response.status_code == status
    assert json.loads(bytes(response.body)) == {
        "error": {
            "message": "x" if exc.message == "x" else exc.message,
            "type": kind,
            "param": exc.param,
            "code": status,
        }
    }


def test_overload_and_unavailable_say_when_to_retry() -> None:
    assert errors.render(Overloaded(retry_after_s=2)).headers["retry-after"] == "2"
    assert errors.render(ServiceUnavailable("x", retry_after_s=7)).headers["retry-after"] == "7"


def test_stream_error_is_one_event_then_done() -> None:
    payloads = sse_payloads(errors.stream_error(EngineError("boom")))
    assert payloads == [
        {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}},
        "[DONE]",
    ]


def test_load_error_mapping_follows_vllm() -> None:
    assert isinstance(routes._load_error(AdapterExists("x"), "a", "/p"), errors.InvalidUserInput)
    missing = routes._load_error(AdapterSourceMissing("No adapter found at 'x'"), "a", "/p")
    assert isinstance(missing, errors.LoraPathNotFound)
    assert missing.message == "Loading lora a failed: No adapter found for /p"
    worded_alike = AdapterInvalid("No adapter found, says the message, but the files are bad")
    assert routes._load_error(worded_alike, "a", "/p") is worded_alike  # the type decides
    rank = AdapterInvalid("LoRA rank 16 is greater than max_lora_rank 8.")
    assert routes._load_error(rank, "a", "/p") is rank
    conflict = routes._load_error(InvalidRequest("conflicts with a served base model"), "a", "/p")
    assert isinstance(conflict, errors.InvalidUserInput)


# ---- routes in process on the fake engine -----------------------------------------------------


def make_context(
    engine: FakeEngine | None = None, *, runtime_lora: bool = True, root: Path | None = None
) -> ProtocolContext:
    engine = engine or FakeEngine(model_name="tiny")
    lifecycle = Lifecycle()
    lifecycle.ready()
    registry = AdapterRegistry(
        engine=engine,
        rules=AdapterRules(
            roots=(str(root or Path.cwd()),), max_rank=8, base_names=frozenset({"tiny"})
        ),
        limits=AdapterLimits(enabled=True, max_loras=2, max_cpu_loras=4),
    )
    service = InferenceService(
        engine=engine,
        adapters=registry,
        lifecycle=lifecycle,
        limits=Limits(),
        base_names=["tiny"],
    )
    return ProtocolContext(
        service=service, bounds=BOUNDS, created=42, allow_runtime_lora=runtime_lora
    )


async def client_for(ctx: ProtocolContext) -> httpx.AsyncClient:
    app = routes_app(routes.routes(ctx))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with await client_for(make_context()) as http:
        yield http


@pytest.mark.anyio
async def test_unknown_model_returns_vllm_404(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `nope` does not exist. Valid aliases: tiny.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "n": "many"}, "body.n"),
        ("/v1/completions", {"prompt": {"a": 1}}, "body.prompt"),
        ("/v1/chat/completions", {"messages": "hi"}, "body.messages"),
        ("/v1/chat/completions", {"messages": []}, "body.messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "body.messages.0.role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
            "body.temperature",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 99}, "n"),
    ],
)
async def test_validation_errors_are_400_with_param(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    # vLLM: pydantic's field errors are "Bad Request", its own checks "BadRequestError"
    kind = "Bad Request" if param.startswith("body.") else "BadRequestError"
    assert (error["type"], error["param"], error["code"]) == (kind, param, 400)
    if kind == "Bad Request":
        listed = r"\d+ validation errors?:\n  \{'type': '\w+', 'loc': 'body\."
        assert re.match(listed, error["message"])


@pytest.mark.anyio
async def test_non_json_bodies_are_400(client: httpx.AsyncClient) -> None:
    bad = await client.post(
        "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "BadRequestError"
    text = await client.post(
        "/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"}
    )
    assert text.status_code == 400
    assert "Only 'application/json' is allowed" in text.json()["error"]["message"]


@pytest.mark.anyio
async def test_x_request_id_becomes_the_response_id(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions",
        headers={"x-request-id": "req-7"},
        json={"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2},
    )
    assert response.status_code == 200
    assert response.json()["id"] == "chatcmpl-req-7"
    body_id = await client.post("/v1/completions", json={"prompt": "a", "request_id": "mine"})
    assert body_id.json()["id"] == "cmpl-mine"


@pytest.mark.anyio
async def test_stream_is_framed_like_vllm(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions",
        json={
            "prompt": "a b c",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response.content)
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["usage"] == {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3}
    assert "".join(p["choices"][0]["text"] for p in payloads[:-2]) == "a b c "


@pytest.mark.anyio
async def test_list_of_prompts_indexes_choices_over_prompts_and_n(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post(
        "/v1/completions",
        json={
            "prompt": ["a b", "c d"],
            "n": 2,
            "max_tokens": 1,
            "echo": True,
        },
    )
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["a ba ", "a bb ", "c dc ", "c dd "]
    assert body["usage"]["prompt_tokens"] == 4


@pytest.mark.anyio
async def test_error_after_stream_start_is_in_band() -> None:
    ctx = make_context(FakeEngine(FakeScript(fail_after=2), model_name="tiny"))
    async with await client_for(ctx) as http:
        response = await http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "a b c"}],
                "stream": True,
            },
        )
        assert response.status_code == 200
        payloads = sse_payloads(response.content)
        assert payloads[-2] == {
            "error": {
                "message": "scripted failure",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
        assert payloads[-1] == "[DONE]"
        assert ctx.service.admission.running == 0  # the slot came back


@pytest.mark.anyio
async def test_engine_rejection_before_output_gets_a_real_status() -> None:
    engine = FakeEngine(
        FakeScript(reject_with=ContextLengthExceeded("too long")), model_name="tiny"
    )
    async with await client_for(make_context(engine)) as http:
        response = await http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "x"}],
                "stream": True,
            },
        )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "too long"


@pytest.mark.anyio
async def test_models_tokenize_detokenize_version(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert (await client.get("/v1/models/tiny")).json() == {
        "id": "tiny",
        "object": "model",
        "created": 42,
        "owned_by": "vllm",
    }
    missing = await client.get("/v1/models/ghost")
    assert (missing.status_code, missing.json()["error"]["type"]) == (404, "NotFoundError")
    tokens = await client.post("/tokenize", json={"prompt": "a b", "return_token_strs": True})
    assert set(tokens.json()) == {"count", "max_model_len", "tokens", "token_strs"}
    assert tokens.json()["count"] == 2
    chat = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
    assert chat.json()["token_strs"] is None
    text = await client.post("/detokenize", json={"tokens": [1, 2]})
    assert text.json() == {"prompt": "t1t2"}
    assert (await client.post("/detokenize", json={"tokens": [10**6]})).status_code == 400
    assert (await client.get("/version")).json() == {"version": "fake"}


@pytest.mark.anyio
async def test_runtime_lora_routes_absent_when_disabled() -> None:
    async with await client_for(make_context(runtime_lora=False)) as http:
        response = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}
        )
    assert response.status_code == 404


@pytest.mark.anyio
async def test_runtime_lora_refusals_without_touching_the_engine(
    client: httpx.AsyncClient,
) -> None:
    empty = await client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert (empty.status_code, empty.json()["error"]["type"]) == (400, "InvalidUserInput")
    base = await client.post(
        "/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": str(Path.cwd())}
    )
    assert (base.status_code, base.json()["error"]["message"]) == (
        400,
        "The lora adapter 'tiny' conflicts with a served base model.",
    )
    gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "ghost"})
    assert gone.status_code == 404
    assert gone.json()["error"] == {
        "message": "The lora adapter 'ghost' cannot be found.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }


@pytest.mark.anyio
async def test_load_serves_the_adapter_and_unload_frees_its_engine_slot(tmp_path: Path) -> None:
    engine = FakeEngine(model_name="tiny")
    write_adapter(tmp_path / "x1")
    async with await client_for(make_context(engine, root=tmp_path)) as http:
        body = {"lora_name": "x1", "lora_path": str(tmp_path / "x1")}
        loaded = await http.post("/v1/load_lora_adapter", json=body)
        assert (loaded.status_code, loaded.text) == (
            200,
            "Success: LoRA adapter 'x1' added successfully.",
        )
        assert loaded.headers["content-type"].startswith("text/plain")
        assert [h.name for h in engine.adapters.values()] == ["x1"]
        answer = await http.post("/v1/completions", json={"model": "x1", "prompt": "a"})
        assert answer.json()["model"] == "x1"
        models = (await http.get("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("x1", "tiny")]
        again = await http.post("/v1/load_lora_adapter", json=body)
        assert again.json()["error"]["type"] == "InvalidUserInput"
        gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "x1"})
        assert (gone.status_code, gone.text) == (
            200,
            "Success: LoRA adapter 'x1' removed successfully.",
        )
        for _ in range(100):  # the engine copy goes as soon as no request uses it
            if not engine.adapters:
                break
            await asyncio.sleep(0)
        assert engine.adapters == {}
        missing = await http.post("/v1/completions", json={"model": "x1", "prompt": "a"})
        assert missing.status_code == 404


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "integer"}},
                }
            },
            StructuredOutput(json_schema='{"type":"integer"}'),
        ),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput(choice=("yes", "no"))),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput(regex="[a-z]+")),
        ({"response_format": {"type": "text"}}, None),
    ],
)
def test_structured_output_fields_map_to_the_core(
    fields: dict[str, Any], expected: StructuredOutput | None
) -> None:
    body = schema.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], **fields}
    )
    assert to_structured(body) == expected


@pytest.mark.parametrize("text", ["", "Hello", 'say "hi"\\n', "é€😀", "\x00\x1f", "a" * 300])
def test_text_only_chat_chunk_is_byte_for_byte_the_general_chunk(text: str) -> None:
    writer = ChunkWriter(META, "chat.completion.chunk")
    choice = {"index": 3, "delta": {"content": text}, "logprobs": None,
              "finish_reason": None, "token_ids": None}
    assert writer.text_chunk(3, text) == writer.chunk(choice)


def test_text_only_chunks_of_several_choices_from_one_writer() -> None:
    """The writer keeps each choice's head: the chunks of choices 0 and 1, interleaved."""
    writer = ChunkWriter(META, "chat.completion.chunk")
    for index, text in ((0, "a"), (1, "b"), (0, "c"), (1, "")):
        choice = {"index": index, "delta": {"content": text}, "logprobs": None,
                  "finish_reason": None, "token_ids": None}
        assert writer.text_chunk(index, text) == writer.chunk(choice)
