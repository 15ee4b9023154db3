"""Settings: layer precedence, MindIE names, DJL options, errors that name the field and a fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.settings import SettingsError, load_settings, redacted


def write_config(tmp_path: Path, data: dict[str, object]) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def test_defaults_follow_mindie_ports() -> None:
    server = load_settings(config_path=None, environ={}).settings.ServerConfig
    assert (server.port, server.managementPort, server.metricsPort) == (1025, 1026, 1027)
    assert server.maxRequestLength == 40


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
    assert loaded.settings.LoraConfig.maxLoras == expected
    assert loaded.provenance["LoraConfig.maxLoras"] == source


def test_djl_options_map_onto_engine_settings(tmp_path: Path) -> None:
    props = tmp_path / "serving.properties"
    props.write_text(
        "option.enable_lora=false\noption.max_lora_rank=16\noption.tensor_parallel_degree=2\n"
        "option.max_rolling_batch_size=64\noption.lora_extra_vocab_size=256\n"
    )
    settings = load_settings(config_path=None, properties_path=props, environ={}).settings
    assert settings.LoraConfig.enabled is False
    assert settings.LoraConfig.maxLoraRank == 16
    assert settings.ModelConfig.tensorParallelSize == 2
    assert settings.ModelConfig.maxNumSeqs == 64
    assert settings.ModelConfig.engineOptions == {"lora_extra_vocab_size": 256}


def test_unknown_key_fails_with_its_path_and_a_fix(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"ServerConfig": {"prot": 8080}})
    pattern = r"config.json: ServerConfig.prot: .*Fix: remove the key"
    with pytest.raises(SettingsError, match=pattern):
        load_settings(config_path=config, environ={})


def test_bad_value_fails_with_source_and_path() -> None:
    with pytest.raises(SettingsError, match=r"environment: ServerConfig.port: .*Fix:"):
        load_settings(config_path=None, environ={"GATEWAY__SERVERCONFIG__PORT": "99999"})


def test_cpu_cache_smaller_than_slots_is_refused(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"LoraConfig": {"maxLoras": 4, "maxCpuLoras": 2}})
    with pytest.raises(SettingsError, match="maxCpuLoras must be >= maxLoras"):
        load_settings(config_path=config, environ={})


def test_invalid_json_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(SettingsError, match="not valid JSON"):
        load_settings(config_path=path, environ={})


def test_secrets_are_redacted(tmp_path: Path) -> None:
    config = write_config(
        tmp_path, {"SecurityConfig": {"apiKeys": ["sk-1"]}, "ServerConfig": {"tlsPkPwd": "pw"}}
    )
    shown = redacted(load_settings(config_path=config, environ={}).settings)
    assert shown["SecurityConfig"]["apiKeys"] == "***"
    assert shown["ServerConfig"]["tlsPkPwd"] == "***"


def test_shipped_config_is_valid(repo_root: Path) -> None:
    settings = load_settings(config_path=repo_root / "config.json", environ={}).settings
    assert settings.ServerConfig.httpsEnabled is True
    assert settings.ModelConfig.modelName == "tiny"
