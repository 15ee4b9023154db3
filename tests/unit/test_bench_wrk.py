"""The benchmark's wrk arm and batch timing: wrk's report parsed, flagged runs, the request carried
into wrk's Lua script byte for byte, streamed responses counted and checked, batch streams split
per prompt."""

from __future__ import annotations

import pytest

from bench.batch import BatchTiming, _Splitter, batch_body
from bench.protocols import PROTOCOLS
from bench.report import b_targets
from bench.wrk import (
    StreamCount,
    bytes_problem,
    check_problems,
    count_stream,
    lua_script,
    lua_string,
    parse_response,
    parse_wrk,
    request_bytes,
    split_events,
)

# wrk 4.1.0 (Debian), as printed against the fake gateway and against a server answering 500.
CLEAN = """\
Running 1s test @ http://127.0.0.1:60451/v1/chat/completions
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     9.36ms    3.39ms  32.29ms   84.81%
    Req/Sec     3.44k   382.94     3.91k    60.00%
  Latency Distribution
     50%    8.43ms
     75%   10.17ms
     90%   12.32ms
     99%   21.79ms
  3423 requests in 1.00s, 2.79MB read
Requests/sec:   3418.62
Transfer/sec:      2.79MB
"""

ERRORS = """\
Running 1s test @ http://127.0.0.1:18805/v1/chat/completions
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    77.65us  254.24us   4.12ms   98.06%
    Req/Sec    80.07k    11.61k   86.47k    90.91%
  Latency Distribution
     50%   45.00us
     75%   52.00us
     90%   60.00us
     99%    1.37ms
  87364 requests in 1.10s, 7.58MB read
  Socket errors: connect 0, read 12, write 0, timeout 3
  Non-2xx or 3xx responses: 87364
Requests/sec:  79434.38
Transfer/sec:      6.89MB
"""


def test_a_clean_wrk_report_gives_throughput_and_latency_in_milliseconds() -> None:
    result = parse_wrk(CLEAN)
    assert (result.threads, result.connections) == (1, 32)
    assert (result.requests, result.duration_s) == (3423, pytest.approx(1.0))
    assert result.req_per_s == pytest.approx(3418.62)
    assert result.latency_ms == pytest.approx(
        {"mean": 9.36, "stdev": 3.39, "max": 32.29, "p50": 8.43, "p75": 10.17, "p90": 12.32,
         "p99": 21.79}
    )  # fmt: skip
    assert (result.errors, result.flagged) == (0, False)


def test_error_responses_and_socket_errors_flag_the_run() -> None:
    result = parse_wrk(ERRORS)
    assert result.latency_ms["p50"] == pytest.approx(0.045)
    assert result.latency_ms["p99"] == pytest.approx(1.37)
    assert result.non_2xx == 87364
    assert result.socket_errors == {"connect": 0, "read": 12, "write": 0, "timeout": 3}
    assert result.errors == 87364 + 15
    assert result.flagged
    assert result.summary()["flagged"] is True


def test_an_aborted_wrk_run_is_flagged_not_counted() -> None:
    result = parse_wrk("unable to connect to 127.0.0.1:18899 Connection refused\n")
    assert result.req_per_s is None
    assert result.requests == 0
    assert result.flagged
    assert any("Requests/sec" in p for p in result.problems)


def test_lua_strings_carry_any_bytes_and_a_digit_after_an_escape_stays_a_digit() -> None:
    assert lua_string(b'a"b\\c') == '"a\\"b\\\\c"'
    assert lua_string("é1".encode()) == '"\\195\\1691"'
    assert lua_string(b"\n1\x00") == '"\\0101\\000"'


def test_the_wrk_script_sets_method_path_body_and_the_clients_headers() -> None:
    script = lua_script(
        "POST", "/generate", b'{"inputs":"x"}', {"Content-Type": "application/json"}
    )
    assert 'wrk.method = "POST"' in script
    assert 'wrk.path = "/generate"' in script
    assert 'wrk.body = "{\\"inputs\\":\\"x\\"}"' in script
    assert 'wrk.headers["Content-Type"] = "application/json"' in script
    assert "function request" not in script  # static: wrk builds the request once


# A streamed run: the script's done() callback prints the exact totals after wrk's own report.
STREAMED = """\
Running 1s test @ http://127.0.0.1:52847/invocations
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    47.22ms   63.32ms 441.74ms   91.05%
    Req/Sec     0.97k   656.57     2.38k    80.00%
  Latency Distribution
     50%   30.31ms
     75%   44.86ms
     90%   95.04ms
     99%  341.43ms
  973 requests in 1.00s, 4.15MB read
Requests/sec:    969.99
Transfer/sec:      4.14MB
bench-totals: requests 973 bytes 4353597
"""


def test_the_exact_byte_count_of_a_streamed_run_is_read_from_the_done_line() -> None:
    result = parse_wrk(STREAMED)
    assert (result.requests, result.bytes_read) == (973, 4353597)
    assert not result.flagged
    assert parse_wrk(CLEAN).bytes_read is None  # non-streamed scripts print no totals


def test_a_streamed_script_prints_totals_once_and_reads_no_response_in_lua() -> None:
    script = lua_script("POST", "/infer", b"{}", {}, totals=True)
    assert "function done(summary, latency, requests)" in script
    assert "summary.requests, summary.bytes" in script
    assert '"bench-totals: requests %.0f bytes %.0f\\n"' in script
    assert "function response" not in script  # no per-response Lua call
    assert "function request" not in script
    assert "function done" not in lua_script("POST", "/infer", b"{}", {})


ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"


def test_a_chat_stream_has_more_events_than_token_events() -> None:
    body = ROLE + TOKEN + TOKEN + USAGE + DONE
    assert split_events(body, b"\n\n") == [ROLE, TOKEN, TOKEN, USAGE, DONE]
    count = count_stream(PROTOCOLS["openai-chat"], body)
    assert count == StreamCount(events=5, text_events=2, tokens=2, error=None, body_bytes=len(body))


def test_json_lines_are_counted_line_by_line_and_blank_lines_are_not_events() -> None:
    line = b'{"token":{"id":1,"text":"a ","log_prob":-0.5}}\n'
    last = b'{"token":{"id":1,"text":"a ","log_prob":-0.5},"generated_text":"a a","details":'
    last += b'{"generated_tokens":3}}\n'
    body = line + b"\n" + line + last
    count = count_stream(PROTOCOLS["djl"], body)
    assert (count.events, count.text_events, count.tokens, count.error) == (3, 3, 3, None)


def test_an_in_band_error_or_an_unreadable_event_is_reported() -> None:
    error = b'data: {"error":{"message":"boom"}}\n\n'
    assert "boom" in (count_stream(PROTOCOLS["tgi"], error).error or "")
    broken = count_stream(PROTOCOLS["tgi"], b"data: {not json\n\n")
    assert broken.error is not None
    assert broken.text_events == 0


def test_a_checked_response_must_match_the_capture() -> None:
    expected = StreamCount(events=67, text_events=64, tokens=64, error=None, body_bytes=15518)
    assert check_problems(200, expected, expected) == []
    short = StreamCount(events=40, text_events=37, tokens=None, error="engine died", body_bytes=9)
    problems = check_problems(500, short, expected)
    assert problems[0] == "check request answered 500"
    assert any("engine died" in p for p in problems)
    assert any("37 token events, the capture has 64" in p for p in problems)
    assert any("40 events, the capture has 67" in p for p in problems)


def test_wrks_byte_count_must_fit_whole_responses_plus_one_partial_per_connection() -> None:
    # 973 responses of 4,473 bytes = 4,352,229; 32 connections may each hold part of one more
    assert bytes_problem(4_353_597, 973, 32, 4473) is None
    assert bytes_problem(973 * 4473 + 30 * 4473, 973, 32, 4473) is None
    cut = bytes_problem(973 * 3000, 973, 32, 4473)
    assert cut is not None
    assert "3000 bytes per response" in cut
    assert bytes_problem(973 * 4473 * 2, 973, 32, 4473) is not None
    assert bytes_problem(None, 973, 32, 4473) is not None  # the done() line went missing
    assert bytes_problem(0, 0, 32, 4473) is None  # nothing completed: flagged elsewhere


CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n"
)


def test_a_chunked_response_is_decoded_and_its_wire_size_counted() -> None:
    response = parse_response(CHUNKED + b"HTTP/1.1 200 OK\r\n")  # the next response is not read
    assert response is not None
    assert (response.status, response.body, response.chunks) == (200, b"hello world", 2)
    assert response.wire_bytes == len(CHUNKED)
    assert response.headers["content-type"] == "text/event-stream"


def test_an_incomplete_response_is_none_until_its_last_chunk_and_blank_line() -> None:
    for end in range(len(CHUNKED)):
        assert parse_response(CHUNKED[:end]) is None
    trailer = CHUNKED[:-2] + b"x-trailer: 1\r\n\r\n"
    parsed = parse_response(trailer)
    assert parsed is not None
    assert parsed.wire_bytes == len(trailer)


def test_a_content_length_response_and_what_is_not_http() -> None:
    raw = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\noops"
    response = parse_response(raw)
    assert response is not None
    assert (response.status, response.body, response.chunks) == (500, b"oops", None)
    assert parse_response(raw[:-1]) is None
    with pytest.raises(ValueError, match="not an HTTP"):
        parse_response(b"SSH-2.0-OpenSSH\r\n\r\n")


def test_the_check_request_is_the_scripts_request() -> None:
    raw = request_bytes("POST", "/infer", "127.0.0.1:8000", b"{}", {"Content-Type": "a/b"})
    assert raw == (
        b"POST /infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: a/b\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )


def test_sse_target_rows_take_wrk_where_measured_and_say_so() -> None:
    b = {
        "whole": {"tgi": {"plain": 0.3}},
        "stream": {"tgi": {"plain": 0.9}, "djl": {"plain": 0.6}},
        "wrk": {"tgi": {"ratio": 0.6}},
        "wrk_stream": {"tgi": {"ratio": 0.75}, "djl": {"ratio": None}},
    }
    rows = {row[0]: row[2:] for row in b_targets(b)}
    assert rows["B: non-streaming requests/s gateway/bare (wrk), tgi"] == ["0.60", "met"]
    assert rows["B: SSE events/s gateway/bare (wrk), tgi"] == ["0.75", "**missed** by 12 %"]
    assert rows["B: SSE events/s gateway/bare (Python client), djl"] == [
        "0.60",
        "**missed** by 29 %",
    ]


def test_a_batch_body_lists_its_prompts_and_one_prompt_stays_a_string() -> None:
    assert b'"prompt":["a","b"]' in batch_body(["a", "b"], 4)
    single = batch_body(["a"], 4)
    assert b'"prompt":"a"' in single
    assert b'"stream":true' in single


def test_the_batch_splitter_times_the_first_token_of_any_and_of_every_prompt() -> None:
    timing = BatchTiming(prompts=2, max_tokens=2, status=200)
    splitter = _Splitter(timing)
    one = b'data: {"choices":[{"index":1,"text":"a"}]}\n\n'
    zero = b'data: {"choices":[{"index":0,"text":"b"}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"completion_tokens":4}}\n\ndata: [DONE]\n\n'
    splitter.feed(one[:10], 0.010)
    splitter.feed(one[10:] + one, 0.020)
    splitter.feed(zero + zero + usage, 0.030)
    assert (timing.first_event_s, timing.all_started_s) == (0.020, 0.030)
    assert timing.token_events == {0: 2, 1: 2}
    assert timing.ok


def test_a_batch_missing_a_prompt_or_with_an_in_band_error_is_not_ok() -> None:
    timing = BatchTiming(prompts=2, max_tokens=1, status=200)
    _Splitter(timing).feed(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n', 0.01)
    assert not timing.ok
    failed = BatchTiming(prompts=1, max_tokens=1, status=200)
    _Splitter(failed).feed(b'data: {"error":{"message":"boom"}}\n\n', 0.01)
    assert failed.error is not None
    assert not failed.ok


def _w(arm: str, rnd: int, req_per_s: float, cpu: float) -> dict[str, object]:
    return {"arm": arm, "label": "tgi-whole", "tags": {"round": rnd}, "workload": {"stream": False},
            "summary": {"req_per_s": req_per_s}, "server_cpu_share": cpu}


class _WrkResults:
    def __init__(self, windows: list[dict[str, object]]) -> None:
        self.windows = windows

    def select(self, scenario: str, **_: object) -> list[dict[str, object]]:
        return self.windows if scenario == "W" else []


def test_granian_arms_are_compared_with_bare_uvicorn_by_throughput_and_cpu_per_request() -> None:
    from bench.report import granian_figures

    windows = [_w("bare", 0, 10_000, 1.0), _w("gateway", 0, 3_000, 1.0),
               _w("gateway-granian", 0, 2_000, 0.5), _w("bare-granian", 0, 8_000, 0.5)]
    tgi = granian_figures(_WrkResults(windows), stream=False)["tgi"]
    assert tgi["gateway-granian"]["ratio"] == pytest.approx(0.2)
    # bare: 100 µs per request; gateway-granian 250 µs: 0.4 of bare with a core each
    assert tgi["gateway-granian"]["cpu_ratio"] == pytest.approx(0.4)
    assert tgi["bare-granian"]["cpu_ratio"] == pytest.approx(1.6)
    assert granian_figures(_WrkResults(windows[:2]), stream=False) == {}


def test_b_arms_keep_their_order_and_start_with_a_gateway_arm() -> None:
    from dataclasses import replace

    from bench.scenarios import Plan, _b_arms

    chosen = _b_arms(replace(Plan(), b_arms=("gateway-granian", "bare")))
    assert [name for name, _ in chosen] == ["gateway-granian", "bare"]
    assert chosen[0][1]["granian"] is True
    assert [name for name, _ in _b_arms(Plan())][:2] == ["gateway", "bare"]
    for bad in (("bare", "gateway"), ("gateway", "nginx")):
        with pytest.raises(SystemExit, match="first must be a gateway arm"):
            _b_arms(replace(Plan(), b_arms=bad))
