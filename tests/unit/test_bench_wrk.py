"""The benchmark's wrk arm and batch timing: wrk's report parsed, flagged runs, the request carried
into wrk's Lua script byte for byte, batch streams split per prompt."""

from __future__ import annotations

import pytest

from bench.batch import BatchTiming, _Splitter, batch_body
from bench.wrk import lua_script, lua_string, parse_wrk

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
