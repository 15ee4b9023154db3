"""RELIABILITY_PERF.md B.7, item by item: the tests that cover each of the 28 items.

`CHECKLIST` names, for every item, the tests (file::function) that prove it; a test below checks
that every named test exists, so the map cannot rot silently. Items that no other module covered
are tested here: #5 on the real engine (unicode, empty and out-of-vocabulary prompts on every
protocol), #13 (an engine failure mid-stream is an in-band error in every protocol's stream
format, then a clean end) and #19's permissive half (the all-interfaces bind is allowed only when
said so). Owners: drain/stop and the control plane (#14-#17) are tests/integration/
test_graceful_stop.py and test_control_plane.py; the adapter API (#24-#27) is tests/conformance/
test_djl_adapters.py, tests/unit/test_adapters.py and tests/integration/test_lora_churn.py.

#23 (rate limiting per key or IP) is not implemented: admission is global (concurrency + queue,
then 429 with Retry-After), which #9 covers; per-IP limits belong to the network (MindIE's
anti-DoS guidance: iptables), as documented in the README.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.runtime.tls import check_bind_address
from server.settings import SettingsError, settings_from_config
from tests.serverproc import ROOT, RunningServer, running_server

C = "tests/conformance/"
I = "tests/integration/"  # noqa: E741
U = "tests/unit/"
ME = f"{I}test_b7_checklist.py::"

CHECKLIST: dict[int, tuple[str, list[str]]] = {
    1: ("malformed JSON, wrong types, missing fields → protocol status and shape", [
        f"{C}test_openai_sdk.py::test_malformed_and_non_json_bodies_are_400",
        f"{C}test_openai_sdk.py::test_bad_requests_are_bad_request_errors",
        f"{C}test_tgi_clients.py::test_malformed_bodies_are_422_validation",
        f"{C}test_tgi_clients.py::test_bad_parameters_are_422_validation_on_every_route",
        f"{C}test_triton_clients.py::test_bad_input_gets_a_triton_error_and_the_engine_keeps_serving",
        f"{C}test_mindie_http.py::test_malformed_json_is_422",
        f"{C}test_mindie_http.py::test_infer_bad_input_is_422",
        f"{C}test_djl_adapters.py::test_invocation_errors_and_serving_continues",
        f"{I}test_fuzz_schemathesis.py::test_every_operation_answers_no_5xx_to_valid_and_invalid_cases",
    ]),
    2: ("unknown model → 404, unknown adapter → 404/TGI parity", [
        f"{C}test_openai_sdk.py::test_unknown_model_is_not_found",
        f"{C}test_tgi_clients.py::test_unknown_adapter_id_is_a_validation_error_for_the_hub_client",
        f"{C}test_triton_clients.py::test_unknown_models_are_404_on_every_get_route",
        f"{C}test_mindie_http.py::test_generate_vllm_flavour_unknown_model_is_404",
    ]),
    3: ("bounds: max_tokens, n, best_of, logprobs, stop list, temperature → 4xx before engine", [
        f"{I}test_limits.py::test_bounds_are_refused_before_the_engine",
        f"{I}test_limits.py::test_live_engine_serves_and_nothing_is_in_flight_after_the_bounds",
        f"{C}test_triton_clients.py::test_engine_bounds_are_triton_400s",
        f"{C}test_tgi_clients.py::test_stream_only_limits_are_refused_before_streaming",
        f"{U}test_translators_property.py::test_openai_completions_translator",
    ]),
    4: ("chat_template_kwargs / extra kwargs not forwarded unvalidated (CVE-2025-62426)", [
        f"{C}test_openai_sdk.py::test_bad_requests_are_bad_request_errors",
        f"{U}test_openai_translate.py::test_chat_template_kwargs_scalars_pass",
        f"{U}test_translators_property.py::test_openai_chat_translator",
    ]),
    5: ("unicode, empty prompt, out-of-vocabulary token ids", [
        f"{ME}test_unicode_empty_and_out_of_vocabulary_prompts_on_every_protocol",
        f"{C}test_triton_clients.py::test_unicode_and_empty_prompts",
        f"{I}test_engine_contract.py::test_bad_prompts_are_domain_errors_before_any_event",
    ]),
    6: ("body > limit → 413 (Content-Length and chunked); exactly the limit accepted", [
        f"{I}test_limits.py::test_body_over_the_limit_is_413_on_every_post_route",
        f"{I}test_limits.py::test_body_of_exactly_the_limit_is_served",
        f"{C}test_tgi_clients.py::test_oversized_body_is_refused",
    ]),
    7: ("header block > limit, > N headers → 431 (httptools alone accepts 8 MB)", [
        f"{I}test_limits.py::test_header_block_over_the_limit_is_431",
        f"{I}test_limits.py::test_too_many_headers_is_431",
        f"{I}test_limits.py::test_endless_8_mb_header_is_cut_off_with_431",
        f"{I}test_limits.py::test_over_long_url_is_414",
    ]),
    8: ("slowloris header and body trickle → closed within the deadline", [
        f"{I}test_limits.py::test_header_trickle_is_closed_with_408",
        f"{I}test_limits.py::test_body_trickle_is_closed",
        f"{I}test_limits.py::test_connection_that_sends_nothing_is_closed",
        f"{I}test_limits.py::test_stream_longer_than_the_receive_deadline_is_not_cut",
    ]),
    9: ("over-admission → 429 + Retry-After, bounded queue, memory stable", [
        f"{I}test_limits.py::test_ten_times_capacity_gets_429_while_admitted_requests_finish",
        f"{I}test_limits.py::test_flood_on_tgi_gets_its_overloaded_shape",
        f"{I}test_limits.py::test_memory_stays_flat_under_a_flood_of_refusals",
    ]),
    10: ("idle keep-alive connections do not block new requests", [
        f"{I}test_limits.py::test_idle_keep_alive_connections_do_not_block_new_requests",
        f"{I}test_limits.py::test_connections_beyond_the_cap_get_503_when_none_is_idle",
    ]),
    11: ("client disconnect mid-stream / while waiting → engine abort, in-flight back to 0", [
        f"{C}test_disconnects.py::test_client_disconnect_aborts_the_engine_request",
        f"{C}test_openai_sdk.py::test_client_disconnect_mid_stream_aborts_the_generation",
        f"{C}test_openai_sdk.py::test_client_disconnect_before_a_non_streamed_answer_aborts_it",
        f"{C}test_triton_clients.py::test_client_disconnect_aborts_a_stream",
    ]),
    12: ("slow SSE reader → dropped after sendTimeout, memory bounded", [
        f"{I}test_limits.py::test_client_that_stops_reading_a_stream_is_dropped_and_its_request_aborted",
    ]),
    13: ("engine error mid-stream → in-band error event, then a clean close", [
        f"{ME}test_engine_failure_mid_stream_is_an_in_band_error_on_every_protocol",
        f"{U}test_tgi_mindie_routes.py::test_an_engine_failure_mid_stream_is_an_in_band_error",
        f"{U}test_streaming.py::test_a_failure_after_the_first_byte_is_the_protocols_in_band_error",
    ]),
    14: ("/stopService drains: in-flight complete, new 503, ready 503, exit; Force aborts", [
        f"{I}test_graceful_stop.py::test_stop_service_drains_32_mixed_requests_then_exits_0",
        f"{I}test_graceful_stop.py::test_force_stop_aborts_at_once_and_exits_0",
        f"{U}test_control.py::test_stop_service_waits_for_in_flight_requests_then_answers_200",
    ]),
    15: ("SIGTERM drains the same way; drain timeout honoured", [
        f"{I}test_graceful_stop.py::test_sigterm_drains_32_mixed_requests_then_exits_0",
        f"{I}test_graceful_stop.py::test_drain_timeout_aborts_the_rest_with_an_in_band_error",
    ]),
    16: ("health: engine dead → MindIE 500; busy → ready 503", [
        f"{I}test_control_plane.py::test_dead_engine_turns_every_health_route_and_request_away",
        f"{U}test_control.py::test_saturated_admission_is_busy_live_200_ready_503",
    ]),
    17: ("role route: unauthorised caller rejected; role change while in flight is safe", [
        f"{I}test_auth.py::test_each_route_opens_to_its_own_class_of_key",
        f"{I}test_auth.py::test_route_without_a_key_is_401_in_its_protocol_envelope",
        f"{I}test_control_plane.py::test_role_decode_refuses_clients_in_their_protocol_then_flex_serves",
        f"{U}test_control.py::test_role_change_leaves_in_flight_requests_running",
    ]),
    18: ("mTLS matrix: good cert, no cert, rogue CA, expired, revoked, TLS ≤ 1.1, plain HTTP, "
         "wrong key", [
        f"{I}test_mtls.py::test_trusted_client_certificate_is_served",
        f"{I}test_mtls.py::test_untrusted_client_is_refused",
        f"{I}test_mtls.py::test_plain_http_to_the_tls_port_gets_no_answer",
        f"{I}test_mtls.py::test_tls_1_1_is_refused_by_the_server_not_by_the_client",
        f"{I}test_mtls.py::test_certificate_without_its_key_cannot_be_offered",
        f"{I}test_mtls.py::test_curl_with_the_readme_flags_is_served",
        f"{I}test_mtls.py::test_curl_without_a_trusted_certificate_is_refused",
        f"{I}test_mtls.py::test_bad_tls_configuration_fails_at_start_naming_the_field",
    ]),
    19: ("httpsEnabled=false refuses 0.0.0.0 unless allowAllZeroIpListening", [
        f"{I}test_mtls.py::test_bad_tls_configuration_fails_at_start_naming_the_field",
        f"{ME}test_all_interfaces_bind_needs_https_or_explicit_permission",
    ]),
    20: ("planes on separate ports/certs; business cert cannot call management", [
        f"{I}test_mtls.py::test_business_certificate_cannot_reach_separated_management_plane",
    ]),
    21: ("API keys on every route of every protocol, constant time; admin for control", [
        f"{I}test_auth.py::test_route_without_a_key_is_401_in_its_protocol_envelope",
        f"{I}test_auth.py::test_route_with_a_wrong_key_is_401",
        f"{I}test_auth.py::test_each_route_opens_to_its_own_class_of_key",
        f"{I}test_auth.py::test_every_key_is_compared_as_a_digest_with_no_early_exit",
        f"{I}test_auth.py::test_openai_sdk_passes_its_api_key",
    ]),
    22: ("Host-header confusion does not bypass path-based auth (CVE-2026-48710/48746)", [
        f"{I}test_auth.py::test_host_header_and_path_tricks_do_not_bypass_auth",
    ]),
    23: ("rate limiting: global admission (per key/IP not implemented, see docstring)", [
        f"{I}test_limits.py::test_ten_times_capacity_gets_429_while_admitted_requests_finish",
    ]),
    24: ("adapter src: '..', outside root, symlink escape, /proc, devices → 4xx first", [
        f"{U}test_adapters.py::test_bad_adapter_is_refused_before_the_engine_sees_it",
        f"{U}test_adapters.py::test_refusal_message_names_the_problem",
        f"{C}test_djl_adapters.py::test_bad_adapter_is_refused_with_a_clear_4xx_and_serving_continues",
    ]),
    25: ("adapter name validation; duplicate → 409; unregister unknown → 404", [
        f"{U}test_adapters.py::test_invalid_or_reserved_names_are_refused",
        f"{U}test_adapters.py::test_duplicate_name_is_refused",
        f"{C}test_djl_adapters.py::test_management_errors_have_djl_shapes",
    ]),
    26: ("safetensors only; bad adapter_config → 4xx; src not shown to non-admins", [
        f"{U}test_adapters.py::test_bad_adapter_is_refused_before_the_engine_sees_it",
        f"{I}test_auth.py::test_model_paths_show_in_v1_models_only_to_admin_callers",
    ]),
    27: ("register while traffic flows; unregister with requests in flight", [
        f"{I}test_lora_churn.py::test_register_and_unregister_while_traffic_flows_lose_nothing",
        f"{I}test_lora_churn.py::test_unregister_with_a_request_in_flight_lets_it_finish",
    ]),
    28: ("fuzz: schemathesis over the OpenAPI description, raw request lines, translators", [
        f"{I}test_fuzz_schemathesis.py::test_live_engine_answers_no_5xx",
        f"{I}test_fuzz_schemathesis.py::test_every_operation_answers_no_5xx_to_valid_and_invalid_cases",
        f"{I}test_fuzz_schemathesis.py::test_raw_request_line_fuzz_never_gets_a_5xx",
        f"{I}test_fuzz_schemathesis.py::test_both_servers_serve_after_their_fuzzing",
        f"{U}test_translators_property.py::test_djl_translator",
        f"{U}test_translators_property.py::test_sse_framing_survives_any_generated_text",
    ]),
}


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    return {node.name for node in tree.body if isinstance(node, functions)}


def test_every_item_of_b7_names_tests_that_exist() -> None:
    assert sorted(CHECKLIST) == list(range(1, 29))
    missing = []
    for item, (_, nodes) in CHECKLIST.items():
        assert nodes, f"item {item} names no test"
        for node in nodes:
            file, _, name = node.partition("::")
            path = ROOT / file
            if not path.is_file() or name not in defined_tests(path):
                missing.append(f"#{item}: {node}")
    assert not missing, "\n".join(missing)


# ---- #5: unicode, empty and out-of-vocabulary prompts on the real engine ----------------------
UNICODE = "héllo wörld — 世界 🤖 \u200b\ufeff \U0010ffff done"
PROMPT_CASES: list[tuple[str, dict[str, Any], int]] = [
    ("/v1/completions", {"prompt": UNICODE, "max_tokens": 3}, 200),
    ("/v1/completions", {"prompt": "", "max_tokens": 3}, 200),  # vLLM: BOS alone is a prompt
    ("/v1/completions", {"prompt": [[]], "max_tokens": 3}, 400),
    ("/v1/completions", {"prompt": [999_999], "max_tokens": 3}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": UNICODE}],
                              "max_tokens": 3}, 200),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}], "max_tokens": 3}, 200),
    ("/detokenize", {"tokens": [999_999]}, 400),
    ("/generate", {"inputs": UNICODE, "parameters": {"max_new_tokens": 3}}, 200),
    ("/generate", {"inputs": "", "parameters": {"max_new_tokens": 3}}, 422),
    ("/generate", {"prompt": UNICODE, "max_tokens": 3}, 200),
    ("/generate", {"prompt": "", "max_tokens": 3}, 422),
    ("/infer", {"inputs": UNICODE, "parameters": {"max_new_tokens": 3}}, 200),
    ("/infer", {"inputs": "", "parameters": {"max_new_tokens": 3}}, 422),
    ("/infer_token", {"input_id": [999_999], "parameters": {"max_new_tokens": 3}}, 422),
    ("/infer_token", {"input_id": [], "parameters": {"max_new_tokens": 3}}, 422),
    ("/v2/models/tiny/generate", {"text_input": UNICODE, "max_tokens": 3}, 200),
    ("/v2/models/tiny/generate", {"text_input": "", "max_tokens": 3}, 200),
    ("/v2/models/tiny/infer", {"inputs": [{"name": "input_ids", "shape": [1],
                                           "datatype": "UINT32", "data": [999_999]}]}, 400),
    ("/invocations", {"inputs": UNICODE, "parameters": {"max_new_tokens": 3}}, 200),
    ("/invocations", {"inputs": "", "parameters": {"max_new_tokens": 3}}, 200),
    ("/v1/tokenizer", {"inputs": UNICODE}, 200),
    ("/tokenize", {"prompt": UNICODE}, 200),
]


def test_unicode_empty_and_out_of_vocabulary_prompts_on_every_protocol(
    live_server: RunningServer,
) -> None:
    with httpx.Client(base_url=live_server.url, timeout=60) as http:
        for path, body, status in PROMPT_CASES:
            response = http.post(path, json=body)
            assert response.status_code == status, (path, body, response.text)
            assert response.json()
        served = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert served.status_code == 200


# ---- #13: an engine failure after the first tokens ---------------------------------------------
@pytest.fixture(scope="module")
def failing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Every generation fails after its third token (FakeScript.fail_after)."""
    overrides = {"ModelConfig": {"engineOptions": {"fail_after": 3}}}
    folder = tmp_path_factory.mktemp("failing")
    with running_server(folder, engine="fake", overrides=overrides, ready_timeout=60) as server:
        yield server


STREAMS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"prompt": "a b c d e", "max_tokens": 8, "stream": True}, "sse"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b c"}],
                              "max_tokens": 8, "stream": True}, "sse"),
    ("/generate_stream", {"inputs": "a b c d", "parameters": {"max_new_tokens": 8}}, "sse"),
    ("/v2/models/tiny/generate_stream", {"text_input": "a b c", "stream": True, "max_tokens": 8},
     "sse"),
    ("/infer", {"inputs": "a b c d", "stream": True, "parameters": {"max_new_tokens": 8}}, "sse"),
    ("/generate", {"prompt": "a b c d", "max_tokens": 8, "stream": True}, "nul"),
    ("/invocations", {"inputs": "a b c d", "stream": True,
                      "parameters": {"max_new_tokens": 8}}, "lines"),
]


def events(body: str, framing: str) -> list[str]:
    if framing == "sse":
        return [line.removeprefix("data:").strip() for line in body.split("\n")
                if line.startswith("data:")]
    separator = "\0" if framing == "nul" else "\n"
    return [part.strip() for part in body.split(separator) if part.strip()]


@pytest.mark.parametrize(("path", "body", "framing"), STREAMS, ids=[s[0] for s in STREAMS])
def test_engine_failure_mid_stream_is_an_in_band_error_on_every_protocol(
    failing: RunningServer, path: str, body: dict[str, Any], framing: str
) -> None:
    with httpx.Client(base_url=failing.url, timeout=60) as http:
        with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200  # the stream had started: the status is sent
            text = response.read().decode()  # and it ends: no hang, no reset
        payloads = [p for p in events(text, framing) if p != "[DONE]"]
        assert len(payloads) >= 2, text  # some tokens, then the error
        last = json.loads(payloads[-1])
        assert "error" in json.dumps(last).lower(), text
        if path.startswith("/v1/"):
            assert text.rstrip().endswith("data: [DONE]")
        short = http.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 2})
        assert short.status_code == 200  # fewer tokens than the failure point: served


# ---- #19: the permissive half -------------------------------------------------------------------
def test_all_interfaces_bind_needs_https_or_explicit_permission() -> None:
    strict = settings_from_config({}, base_dir=ROOT).server
    lenient = settings_from_config(
        {"ServerConfig": {"allowAllZeroIpListening": True}}, base_dir=ROOT
    ).server
    for host in ("0.0.0.0", "::", "", "[::]"):
        with pytest.raises(SettingsError, match="allowAllZeroIpListening"):
            check_bind_address(strict, host, tls=False)
        check_bind_address(strict, host, tls=True)
        check_bind_address(lenient, host, tls=False)
    check_bind_address(strict, "127.0.0.1", tls=False)
