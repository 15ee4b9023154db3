"""Settings loading: layer precedence, MindIE names, DJL options, and errors that name the key as
the user wrote it, its source and a fix. (The alias table and redaction: test_settings_mapping.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from server.settings import SettingsError, load_settings, settings_from_config

TYPE_FIX = "Fix: give a value of the expected type and range"
SPELLING_FIX = "Fix: remove the key or correct its spelling (see README, Configuration)"
UNKNOWN = f"Extra inputs are not permitted. {SPELLING_FIX}"


def write_config(tmp_path: Path, data: dict[str, object]) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def load_error(tmp_path: Path, config: dict[str, Any], **layers: Any) -> str:
    """The message of the SettingsError that loading these layers raises."""
    with pytest.raises(SettingsError) as caught:
        load_settings(
            config_path=write_config(tmp_path, config),
            properties_path=layers.get("properties_path"),
            environ=layers.get("environ", {}),
            cli=layers.get("cli"),
        )
    return str(caught.value)


# ---- defaults and layers -----------------------------------------------------------------------
def test_defaults_follow_mindie_ports() -> None:
    server = load_settings(config_path=None, environ={}).settings.server
    assert (server.data.port, server.management.port, server.metrics.port) == (1025, 1026, 1027)
    assert server.data.host == server.management.host == server.metrics.host == "127.0.0.1"
    assert server.max_request_mb == 40
    assert server.max_request_bytes == 40 * 1024 * 1024


@pytest.mark.parametrize(
    ("properties", "environ", "cli", "expected", "source"),
    [
        ({}, {}, {}, 5, "config.json"),
        ({"option.max_loras": "6"}, {}, {}, 6, "serving.properties"),
        ({"option.max_loras": "6"}, {"OPTION_MAX_LORAS": "7"}, {}, 7, "environment"),
        ({}, {"GATEWAY__LORACONFIG__MAXLORAS": "8"}, {}, 8, "environment"),
        ({"option.max_loras": "6"}, {"OPTION_MAX_LORAS": "7"}, {"LoraConfig": {"maxLoras": 9}}, 9,
         "command line"),
    ],
)
def test_layers_override_in_order(
    tmp_path: Path, properties: dict[str, str], environ: dict[str, str],
    cli: dict[str, object], expected: int, source: str,
) -> None:
    config = write_config(tmp_path, {"LoraConfig": {"maxLoras": 5, "maxCpuLoras": 10}})
    props = tmp_path / "serving.properties"
    props.write_text("\n".join(f"{k}={v}" for k, v in properties.items()))
    loaded = load_settings(config_path=config, properties_path=props, environ=environ, cli=cli)
    assert loaded.settings.lora.max_loras == expected
    assert loaded.provenance["LoraConfig.maxLoras"] == source
    assert loaded.provenance["LoraConfig.maxCpuLoras"] == "config.json"


def test_layers_merge_key_by_key_and_a_higher_layer_wins_per_key(tmp_path: Path) -> None:
    config = write_config(
        tmp_path, {"ServerConfig": {"port": 9000, "managementPort": 9001, "tlsCert": "a.pem"}}
    )
    loaded = load_settings(
        config_path=config,
        environ={"GATEWAY__SERVERCONFIG__MANAGEMENTPORT": "9101"},
        cli={"ServerConfig": {"tlsCert": "c.pem"}},
    )
    server = loaded.settings.server
    assert (server.data.port, server.management.port, server.metrics.port) == (9000, 9101, 1027)
    assert server.data.tls.cert == server.management.tls.cert == "c.pem"
    assert loaded.provenance == {
        "ServerConfig.port": "config.json",
        "ServerConfig.managementPort": "environment",
        "ServerConfig.tlsCert": "command line",
    }


def test_environment_names_are_matched_case_insensitively(tmp_path: Path) -> None:
    loaded = load_settings(
        config_path=None,
        environ={
            "GATEWAY__SERVERCONFIG__MANAGEMENTTLSCERT": "m.pem",
            "GATEWAY__ENGINE": "fake",
            "GATEWAY__MODELCONFIG__ENGINEOPTIONS__token_delay_s": "0.5",
        },
    )
    assert loaded.settings.server.management.tls.cert == "m.pem"
    assert loaded.settings.engine == "fake"
    assert loaded.settings.model.engine_options == {"token_delay_s": 0.5}
    assert loaded.provenance["ServerConfig.managementTlsCert"] == "environment"


def test_djl_options_map_onto_engine_settings(tmp_path: Path) -> None:
    props = tmp_path / "serving.properties"
    props.write_text(
        "option.enable_lora=false\noption.max_lora_rank=16\noption.tensor_parallel_degree=2\n"
        "option.max_rolling_batch_size=64\noption.lora_extra_vocab_size=256\nengine=Fake\n"
    )
    settings = load_settings(config_path=None, properties_path=props, environ={}).settings
    assert settings.lora.enabled is False
    assert settings.lora.max_lora_rank == 16
    assert settings.model.tensor_parallel_size == 2
    assert settings.model.max_num_seqs == 64
    assert settings.model.engine_options == {"lora_extra_vocab_size": 256}
    assert settings.engine == "fake"


@pytest.mark.parametrize(
    ("properties", "environ", "rolling_batch", "tgi_compat"),
    [
        ("", {}, "auto", False),  # LMI's default: async mode
        ("option.rolling_batch=vllm\n", {}, "vllm", False),
        ("option.rolling_batch=lmi-dist\noption.tgi_compat=true\n", {}, "lmi-dist", True),
        ("", {"OPTION_ROLLING_BATCH": "vllm", "OPTION_TGI_COMPAT": "true"}, "vllm", True),
        ("option.rolling_batch=vllm\n", {"OPTION_ROLLING_BATCH": "auto"}, "auto", False),
    ],
)
def test_djl_protocol_switches_come_from_djl_options(
    tmp_path: Path, properties: str, environ: dict[str, str], rolling_batch: str, tgi_compat: bool
) -> None:
    props = tmp_path / "serving.properties"
    props.write_text(properties)
    settings = load_settings(config_path=None, properties_path=props, environ=environ).settings
    assert (settings.protocols.rolling_batch, settings.protocols.tgi_compat) == (
        rolling_batch, tgi_compat
    )


def test_a_rolling_batch_the_gateway_cannot_serve_fails_at_start_up(tmp_path: Path) -> None:
    message = load_error(tmp_path, {}, environ={"OPTION_ROLLING_BATCH": "disable"})
    assert message.startswith("environment: ProtocolConfig.rollingBatch: Input should be 'auto'")


def test_relative_paths_start_at_the_config_folder(tmp_path: Path) -> None:
    from server.settings import resolve_path

    settings = load_settings(config_path=write_config(tmp_path, {}), environ={}).settings
    assert settings.base_dir == str(tmp_path.resolve())
    assert resolve_path(settings, "certs/ca.pem") == str(tmp_path.resolve() / "certs/ca.pem")
    assert resolve_path(settings, "/abs/ca.pem") == "/abs/ca.pem"


def test_settings_from_config_reads_config_names(tmp_path: Path) -> None:
    settings = settings_from_config({"LimitsConfig": {"maxN": 3}}, base_dir=tmp_path)
    assert settings.limits.max_n == 3
    assert settings.base_dir == str(tmp_path)


def test_shipped_config_is_valid(repo_root: Path) -> None:
    settings = load_settings(config_path=repo_root / "config.json", environ={}).settings
    assert settings.server.data.tls.enabled is True
    assert settings.server.management.tls.enabled is True  # from httpsEnabled
    assert settings.model.name == "tiny"


# ---- errors name the key as written, its source and a fix -------------------------------------
def test_unknown_key_fails_with_its_path_and_a_fix(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"ServerConfig": {"prot": 8080}})
    assert message == (
        "config.json: ServerConfig.prot: Extra inputs are not permitted. "
        "Fix: remove the key or correct its spelling (see README, Configuration)"
    )


@pytest.mark.parametrize(
    ("config", "line"),
    [
        ({"FooConfig": {"a": 1}}, f"config.json: FooConfig: {UNKNOWN}"),
        ({"ServerConfig": {"foo": {"a": 1}}}, f"config.json: ServerConfig.foo: {UNKNOWN}"),
        ({"LoraConfig": {"adapters": [{"name": "a", "path": "p", "pinned": True}]}},
         f"config.json: LoraConfig.adapters.0.pinned: {UNKNOWN}"),
        ({"ServerConfig": 5},
         f"config.json: ServerConfig: Input should be a valid dictionary. {TYPE_FIX}"),
        # snake_case names are internal: the config file does not accept them
        ({"ServerConfig": {"max_links": 5}}, f"config.json: ServerConfig.max_links: {UNKNOWN}"),
        ({"server": {"data": {"port": 5}}}, f"config.json: server: {UNKNOWN}"),
    ],
)
def test_unknown_keys_and_sections_are_named(
    tmp_path: Path, config: dict[str, Any], line: str
) -> None:
    assert load_error(tmp_path, config) == line


@pytest.mark.parametrize(
    ("environ", "line"),
    [
        ({"GATEWAY__SERVERCONFIG__PORT": "99999"},
         "environment: ServerConfig.port: Input should be less than or equal to 65535. "
         f"{TYPE_FIX}"),
        ({"GATEWAY__LORACONFIG__MAXLORAS": "0"},
         "environment: LoraConfig.maxLoras: Input should be greater than or equal to 1. "
         f"{TYPE_FIX}"),
        ({"OPTION_MAX_LORAS": "abc"},
         "environment: LoraConfig.maxLoras: Input should be a valid integer, unable to parse "
         f"string as an integer. {TYPE_FIX}"),
        ({"GATEWAY__SERVERCONFIG__METRICSTLSCAFILE": '["a", "b", "c", "d"]'},
         "environment: ServerConfig.metricsTlsCaFile: List should have at most 3 items after "
         f"validation, not 4. {TYPE_FIX}"),
        ({"GATEWAY__SERVERCONFIG__PROT": "1"},
         f"environment: ServerConfig.PROT: {UNKNOWN}"),
    ],
)
def test_bad_environment_values_name_the_key_and_the_environment(
    tmp_path: Path, environ: dict[str, str], line: str
) -> None:
    assert load_error(tmp_path, {}, environ=environ) == line


def test_bad_command_line_and_properties_values_name_their_source(tmp_path: Path) -> None:
    cli_error = load_error(tmp_path, {}, cli={"LoraConfig": {"maxLoras": -1}})
    assert cli_error == (
        f"command line: LoraConfig.maxLoras: Input should be greater than or equal to 1. {TYPE_FIX}"
    )
    props = tmp_path / "serving.properties"
    props.write_text("option.max_lora_rank=7\n")
    properties_error = load_error(tmp_path, {}, properties_path=props)
    assert properties_error == (
        "serving.properties: LoraConfig.maxLoraRank: Input should be 1, 8, 16, 32, 64, 128, 256, "
        "320 or 512. Fix: use one of the allowed values above"
    )


def test_cross_field_error_names_the_config_keys_and_their_source(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"LoraConfig": {"maxLoras": 4, "maxCpuLoras": 2}})
    assert message == (
        f"config.json: LoraConfig: Value error, maxCpuLoras must be >= maxLoras. {TYPE_FIX}"
    )
    from_env = load_error(tmp_path, {}, environ={"OPTION_MAX_LORAS": "8"})  # maxCpuLoras: 4
    assert from_env.startswith("environment: LoraConfig: Value error, maxCpuLoras must be >=")


def test_active_adapters_default_to_the_engine_cached_places_and_split_over_workers(
    tmp_path: Path,
) -> None:
    from server.gateway import service_limits

    def limits(lora: dict[str, Any], workers: int = 1) -> tuple[int, int]:
        config = {"LoraConfig": lora, "ServerConfig": {"workers": workers}}
        made = service_limits(settings_from_config(config, base_dir=tmp_path))
        return made.adapter_slots, made.prefetch

    assert limits({"maxLoras": 2, "maxCpuLoras": 4}) == (4, 0)
    assert limits({"maxLoras": 2, "maxCpuLoras": 4, "maxActiveAdapters": 2}) == (2, 2)
    assert limits({"maxLoras": 2, "maxCpuLoras": 4, "maxActiveAdapters": 3}) == (3, 1)
    assert limits({"maxActiveAdapters": 0}) == (0, 0)
    assert limits({"maxLoras": 2, "maxCpuLoras": 4}, workers=3) == (2, 0)
    assert limits({"enabled": False}) == (0, 0)
    message = load_error(tmp_path, {"LoraConfig": {"maxCpuLoras": 4, "maxActiveAdapters": 5}})
    assert "maxActiveAdapters must be <= maxCpuLoras" in message


def test_more_pinned_config_adapters_than_may_be_pinned_stop_the_start(tmp_path: Path) -> None:
    """The registry refuses a pin past max_pins; at start that left the server ready without
    those adapters (a logged error): the config is refused instead, naming the limit."""
    def pinned(count: int, **lora: Any) -> dict[str, Any]:
        entries = [{"name": f"p{i}", "path": "/x", "pin": True} for i in range(count)]
        return {"LoraConfig": {"adapters": entries, **lora}}

    message = load_error(tmp_path, pinned(3, maxLoras=2, maxCpuLoras=4))
    assert "adapters: 3 entries are pinned, at most 2 may be" in message
    assert "4 entries are pinned, at most 3" in load_error(tmp_path, pinned(4, maxLoras=3))
    settings_from_config(pinned(2, maxLoras=2, maxCpuLoras=4), base_dir=tmp_path)
    settings_from_config(pinned(5, enabled=False), base_dir=tmp_path)


def test_management_key_errors_name_the_management_key(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"ServerConfig": {"managementTlsCert": 5}})
    assert message == (
        f"config.json: ServerConfig.managementTlsCert: Input should be a valid string. {TYPE_FIX}"
    )


def test_a_bad_value_inherited_by_other_listeners_is_reported_once(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"ServerConfig": {"tlsCert": 5, "tlsCaFile": []}})
    assert message.splitlines() == [
        "config.json: ServerConfig.tlsCaFile: List should have at least 1 item after validation, "
        f"not 0. {TYPE_FIX}",
        f"config.json: ServerConfig.tlsCert: Input should be a valid string. {TYPE_FIX}",
    ]


def test_every_problem_is_listed_in_config_file_order(tmp_path: Path) -> None:
    config = {
        "LoggingConfig": {"level": "LOUD"},
        "FooConfig": {},
        "ServerConfig": {"keepAliveTimeout": 0, "prot": 1, "port": "x"},
        "engine": "x",
    }
    lines = load_error(tmp_path, config).splitlines()
    assert [line.split(": ")[1] for line in lines] == [
        "engine",
        "ServerConfig.port",
        "ServerConfig.keepAliveTimeout",
        "ServerConfig.prot",
        "LoggingConfig.level",
        "FooConfig",
    ]
    assert lines[0] == "config.json: engine: Input should be 'vllm' or 'fake'. " \
        "Fix: use one of the allowed values above"


def test_adapter_entry_errors_name_the_entry(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"LoraConfig": {"adapters": [{"name": "a"}]}})
    assert message == f"config.json: LoraConfig.adapters.0.path: Field required. {TYPE_FIX}"


def test_invalid_json_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(SettingsError, match="not valid JSON"):
        load_settings(config_path=path, environ={})


def test_start_up_refuses_another_uvicorn_minor_with_a_fix() -> None:
    from server.runtime.limits import UVICORN_SERIES, UnsupportedUvicorn, check_uvicorn

    check_uvicorn()  # the installed one is the pinned one
    check_uvicorn(f"{UVICORN_SERIES}.9")
    with pytest.raises(UnsupportedUvicorn, match=r"uvicorn 0\.99\.0 is installed.*Fix: pip"):
        check_uvicorn("0.99.0")
