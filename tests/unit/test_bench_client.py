"""The benchmark's measuring code: stream splitting, per-protocol token events, vLLM's formulas."""

from __future__ import annotations

import pytest

from bench.http import Target
from bench.load import Record, _Reader
from bench.protocols import PROTOCOLS
from bench.stats import summarize


def _read(protocol: str, chunks: list[tuple[float, bytes]]) -> Record:
    record = Record(index=0, model="tiny")
    reader = _Reader(PROTOCOLS[protocol], record, started=0.0)
    for at, chunk in chunks:
        reader.feed(chunk, at)
    reader.finish(chunks[-1][0])
    record.latency = reader.last
    return record


def test_chat_role_chunk_does_not_stop_the_ttft_clock() -> None:
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    token = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n'
    record = _read(
        "openai-chat",
        [(0.010, role), (0.050, token), (0.060, token[:20]), (0.070, token[20:] + usage)],
    )
    record.ok = True
    assert record.ttft == pytest.approx(0.050)
    assert record.itl == [pytest.approx(0.020)]
    assert (record.tokens, record.prompt_tokens, record.text_events) == (2, 5, 2)


def test_completion_chunks_with_empty_text_still_count_as_token_steps() -> None:
    empty = b'data: {"choices":[{"index":0,"text":""}]}\n\n'
    record = _read("openai-completions", [(0.02, empty), (0.03, empty + b"data: [DONE]\n\n")])
    assert record.ttft == pytest.approx(0.02)
    assert record.text_events == 2


def test_tgi_and_mindie_count_one_token_per_event_and_read_the_final_details() -> None:
    tgi = (
        b'data:{"index":1,"token":{"id":5,"text":" a","special":false},"generated_text":null}\n\n'
        b'data:{"index":2,"token":{"id":6,"text":" b","special":false},"generated_text":" a b",'
        b'"details":{"finish_reason":"length","generated_tokens":2}}\n\n'
    )
    assert _read("tgi", [(0.01, tgi)]).tokens == 2
    mindie = (
        b'data: {"prefill_time":1.0,"token":{"id":5,"text":"a"}}\n\n'
        b'data: {"decode_time":1.0,"generated_text":"ab","details":{"generated_tokens":2},'
        b'"token":{"id":6,"text":null}}\n\n'
    )
    record = _read("mindie", [(0.01, mindie)])
    assert (record.text_events, record.tokens) == (2, 2)


def test_djl_json_lines_without_trailing_newline_are_read() -> None:
    lines = b'{"token":{"id":1,"text":"a"}}\n{"token":{"id":2,"text":"b"},"generated_text":"ab"}'
    assert _read("djl", [(0.01, lines)]).text_events == 2


def test_anthropic_events_count_deltas_and_read_the_usage() -> None:
    events = (
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
        b'{"input_tokens":5,"output_tokens":0}}}\n\n'
        b'event: ping\ndata: {"type":"ping"}\n\n'
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"a"}}\n\n'
    )
    tail = (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"b"}}\n\n'
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
        b'"max_tokens"},"usage":{"input_tokens":5,"output_tokens":2}}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    record = _read("anthropic", [(0.02, events), (0.05, tail)])
    record.ok = True
    assert record.ttft == pytest.approx(0.02)
    assert (record.tokens, record.prompt_tokens, record.text_events) == (2, 5, 2)
    failed = b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"x"}}\n\n'
    assert "api_error" in (_read("anthropic", [(0.01, failed)]).error or "")


def test_stream_error_event_marks_the_request_failed() -> None:
    event = b'data: {"error":{"message":"boom","type":"InternalServerError"}}\n\n'
    assert "boom" in (_read("openai-chat", [(0.01, event)]).error or "")


def test_tpot_follows_vllm_latency_minus_ttft_over_tokens_minus_one() -> None:
    rows = [
        {"ok": True, "error": None, "tokens": 11, "tokens_reported": True, "prompt_tokens": 4,
         "latency": 0.120, "ttft": 0.020, "itl": [0.01] * 10, "text_events": 11},
        {"ok": False, "error": "HTTP 500", "tokens": 0, "tokens_reported": False,
         "prompt_tokens": None, "latency": None, "ttft": None, "itl": [], "text_events": 0},
    ]  # fmt: skip
    summary = summarize(rows, duration_s=2.0)
    assert summary["tpot_ms"]["median"] == pytest.approx(10.0)
    assert (summary["completed"], summary["failed"]) == (1, 1)
    assert summary["out_tok_per_s"] == pytest.approx(5.5)


def test_load_generator_refuses_non_loopback_targets() -> None:
    with pytest.raises(ValueError, match="loopback"):
        Target.parse("http://10.0.0.1:8000")
    assert Target.parse("http://127.0.0.1:8000").port == 8000
