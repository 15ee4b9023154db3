"""The alias table between the config file's names and the internal model: completeness, the
management/metrics fallbacks, and `redacted` (config names and shape, as before the model moved
to snake_case)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from server.settings import Settings, load_settings, redacted, settings_from_config
from server.settings.loader import ALIASES, DJL_OPTIONS, FALLBACKS

# `redacted` of the defaults, as the camelCase model dumped them (base_dir aside).
DEFAULTS: dict[str, Any] = {
    "engine": "vllm",
    "ServerConfig": {
        "ipAddress": "127.0.0.1", "port": 1025, "managementIpAddress": None,
        "managementPort": 1026, "metricsIpAddress": None, "metricsPort": 1027,
        "grpcIpAddress": None, "grpcPort": None,
        "allowAllZeroIpListening": False, "httpsEnabled": True, "tlsCaPath": "certs/",
        "tlsCaFile": ["ca.pem"], "tlsCert": "certs/server.pem", "tlsPk": "certs/server.key",
        "tlsPkPwd": None, "tlsCrlPath": "certs/", "tlsCrlFiles": [],
        "managementHttpsEnabled": None, "managementTlsCaFile": None, "managementTlsCert": None,
        "managementTlsPk": None, "managementTlsPkPwd": None, "managementTlsCrlPath": None,
        "managementTlsCrlFiles": None, "metricsHttpsEnabled": None, "metricsTlsCaFile": None,
        "metricsTlsCert": None, "metricsTlsPk": None, "metricsTlsPkPwd": None,
        "metricsTlsCrlPath": None, "metricsTlsCrlFiles": None,
        "grpcHttpsEnabled": None, "grpcTlsCaFile": None, "grpcTlsCert": None, "grpcTlsPk": None,
        "grpcTlsPkPwd": None, "grpcTlsCrlPath": None, "grpcTlsCrlFiles": None,
        "maxLinkNum": 1000,
        "maxRequestLength": 40, "maxHeaderBytes": 65536, "maxHeaderCount": 100,
        "requestReceiveTimeout": 30.0, "sendTimeout": 60.0, "keepAliveTimeout": 5.0,
        "workers": 1,
        "drainDelay": 5.0,
        "httpRunner": "uvicorn",
    },
    "ModelConfig": {
        "modelName": "tiny", "modelWeightPath": "build/demo/model", "dtype": "float32",
        "maxModelLen": 512, "maxNumSeqs": 32, "seed": 0, "enforceEager": True,
        "tensorParallelSize": 1, "pipelineParallelSize": 1, "dataParallelSize": 1,
        "distributedExecutorBackend": None,
        "kvCacheSpaceGiB": 1, "toolCallParser": None, "reasoningParser": None,
        "aliases": ["tgi", "dummy"],
        "engineOptions": {},
    },
    "LoraConfig": {
        "enabled": True, "maxLoras": 2, "maxLoraRank": 8, "maxCpuLoras": 4, "loraDtype": "auto",
        "fullyShardedLoras": False, "adapterDir": "build/demo/adapters", "adapterRoots": [],
        "adapters": [], "workflows": [], "allowRuntimeUpdates": True, "onDemand": True,
        "adapterDirRefresh": 5.0, "stateFile": None, "adapterSources": [],
        "adapterCacheDir": None, "adapterCacheGiB": 20.0, "adapterSourceTimeout": 20.0,
        "adapterSourceCaFile": None, "mergedAdapterDir": None, "maxMergedAdapters": 32,
        "maxActiveAdapters": None, "adapterCycleTime": 2.0,
    },
    "LimitsConfig": {
        "maxConcurrentRequests": 256, "maxQueue": 512, "fairAdmission": True,
        "queueTimeout": 60.0, "requestTimeout": 600.0, "drainTimeout": 30.0,
        "engineCheckInterval": 5.0, "maxN": 16,
        "maxBestOf": 16, "maxStopSequences": 16, "maxLogprobs": 20, "maxPromptsPerRequest": 64,
    },
    "ProtocolConfig": {"rollingBatch": "auto", "tgiCompat": False},
    "SecurityConfig": {"apiKeys": [], "adminKeys": []},
    "LoggingConfig": {"level": "INFO", "json_format": False, "logPrompts": False,
                      "accessLog": False},
}

TLS_KEYS = {  # data key: management key, metrics key, internal name, two non-default values
    "httpsEnabled": ("managementHttpsEnabled", "metricsHttpsEnabled", "enabled", False, True),
    "tlsCaFile": ("managementTlsCaFile", "metricsTlsCaFile", "ca_files", ["a.pem"], ["b.pem"]),
    "tlsCert": ("managementTlsCert", "metricsTlsCert", "cert", "/x/server.pem", "/y.pem"),
    "tlsPk": ("managementTlsPk", "metricsTlsPk", "key", "/x/server.key", "/y.key"),
    "tlsPkPwd": ("managementTlsPkPwd", "metricsTlsPkPwd", "key_password_file", "/x/pw", "/y"),
    "tlsCrlPath": ("managementTlsCrlPath", "metricsTlsCrlPath", "crl_path", "/x/", "/y/"),
    "tlsCrlFiles": ("managementTlsCrlFiles", "metricsTlsCrlFiles", "crl_files", ["c.pem"], []),
}


def with_defaults(config: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """DEFAULTS with `config` merged over them, key by key."""
    merged = copy.deepcopy(DEFAULTS)
    for section, value in config.items():
        if isinstance(value, dict) and section != "engineOptions":
            merged[section].update(value)
        else:
            merged[section] = value
    merged["base_dir"] = str(base_dir)
    return merged


def model_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every leaf field (a field that is not itself a model)."""
    paths = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths += model_fields(annotation, f"{prefix}{name}.")
        else:
            paths.append(f"{prefix}{name}")
    return paths


# ---- the alias table ---------------------------------------------------------------------------
def test_every_model_field_has_exactly_one_alias() -> None:
    targets = [target for paths in ALIASES.values() for target in paths]
    assert sorted(targets) == sorted(model_fields(Settings))  # no field twice, none missing


def test_every_alias_names_a_model_field() -> None:
    fields = set(model_fields(Settings))
    for path, targets in ALIASES.items():
        assert targets, path
        assert set(targets) <= fields, path


def test_config_keys_differ_in_more_than_case() -> None:
    """GATEWAY__SECTION__KEY is matched case-insensitively, so no two keys may collide."""
    assert len({path.lower() for path in ALIASES}) == len(ALIASES)


def test_djl_options_and_fallbacks_name_known_keys() -> None:
    assert set(DJL_OPTIONS.values()) <= set(ALIASES)
    fields = set(model_fields(Settings))
    for target, fallback in FALLBACKS:
        assert {target, fallback} <= fields


def test_tls_ca_path_is_shared_by_every_listener(tmp_path: Path) -> None:
    settings = settings_from_config({"ServerConfig": {"tlsCaPath": "/ca/"}}, base_dir=tmp_path)
    listeners = (settings.server.data, settings.server.management, settings.server.metrics)
    assert {listener.tls.ca_path for listener in listeners} == {"/ca/"}


# ---- fallbacks of the management and metrics listeners ------------------------------------------
@pytest.mark.parametrize("data_key", sorted(TLS_KEYS))
def test_each_management_and_metrics_tls_field_falls_back_to_the_data_one(
    tmp_path: Path, data_key: str
) -> None:
    management_key, metrics_key, name, value, other = TLS_KEYS[data_key]
    server = settings_from_config({"ServerConfig": {data_key: value}}, base_dir=tmp_path).server
    assert getattr(server.data.tls, name) == value
    assert getattr(server.management.tls, name) == value
    assert getattr(server.metrics.tls, name) == value
    config = {"ServerConfig": {data_key: value, management_key: None, metrics_key: other}}
    server = settings_from_config(config, base_dir=tmp_path).server
    assert getattr(server.management.tls, name) == value  # null: as absent
    assert getattr(server.metrics.tls, name) == other  # given: the listener's own


def test_a_management_tls_field_does_not_change_the_others(tmp_path: Path) -> None:
    settings = settings_from_config(
        {"ServerConfig": {"httpsEnabled": False, "managementHttpsEnabled": True,
                          "managementTlsCaFile": ["rogue-ca.pem"]}},
        base_dir=tmp_path,
    )
    server = settings.server
    assert (server.data.tls.enabled, server.management.tls.enabled) == (False, True)
    assert server.metrics.tls.enabled is False  # metrics TLS falls back to data, not management
    assert server.management.tls.ca_files == ["rogue-ca.pem"]
    assert server.data.tls.ca_files == server.metrics.tls.ca_files == ["ca.pem"]


@pytest.mark.parametrize(
    ("server_config", "hosts"),
    [
        ({}, ("127.0.0.1", "127.0.0.1", "127.0.0.1")),
        ({"ipAddress": "10.0.0.1"}, ("10.0.0.1", "10.0.0.1", "10.0.0.1")),
        ({"ipAddress": "10.0.0.1", "managementIpAddress": "10.0.0.2"},
         ("10.0.0.1", "10.0.0.2", "10.0.0.2")),  # metrics follows management
        ({"ipAddress": "10.0.0.1", "metricsIpAddress": "10.0.0.3"},
         ("10.0.0.1", "10.0.0.1", "10.0.0.3")),
        ({"ipAddress": "10.0.0.1", "managementIpAddress": "", "metricsIpAddress": None},
         ("10.0.0.1", "10.0.0.1", "10.0.0.1")),  # empty or null: as absent
    ],
)
def test_listener_hosts_fall_back(
    tmp_path: Path, server_config: dict[str, Any], hosts: tuple[str, str, str]
) -> None:
    server = settings_from_config({"ServerConfig": server_config}, base_dir=tmp_path).server
    assert (server.data.host, server.management.host, server.metrics.host) == hosts


def test_listener_by_role() -> None:
    server = Settings().server
    assert server.listener("metrics") is server.metrics
    with pytest.raises(ValueError, match="unknown listener"):
        server.listener("admin")


# ---- redacted: config names and shape ----------------------------------------------------------
def test_defaults_are_redacted_as_before(tmp_path: Path) -> None:
    shown = redacted(settings_from_config({}, base_dir=tmp_path))
    assert shown == {**DEFAULTS, "base_dir": str(tmp_path)}
    assert list(shown) == [*DEFAULTS, "base_dir"]
    assert list(shown["ServerConfig"]) == list(DEFAULTS["ServerConfig"])


ROUND_TRIP_CONFIG: dict[str, Any] = {
    "engine": "fake",
    "ServerConfig": {
        "ipAddress": "10.1.1.1", "port": 5000, "managementPort": 5001,
        "metricsIpAddress": "10.1.1.3", "metricsPort": 5002, "httpsEnabled": False,
        "managementHttpsEnabled": True,
        "tlsCaPath": "/c", "tlsCert": "/c/server.pem", "managementTlsCaFile": ["m-ca.pem"],
        "metricsTlsCrlFiles": ["crl.pem"], "maxRequestLength": 1, "sendTimeout": 9.5,
    },
    "ModelConfig": {
        "modelName": "m", "maxModelLen": None, "engineOptions": {"token_delay_s": 0.05}
    },
    "LoraConfig": {"maxLoras": 3, "adapters": [{"name": "x", "path": "p", "pin": True,
                                                "preload": False}], "workflows": ["w"]},
    "LimitsConfig": {"maxQueue": 0, "drainTimeout": 20},
    "LoggingConfig": {"level": "DEBUG", "json_format": True, "accessLog": True},
}


def test_redacted_round_trip_is_the_input_plus_defaults(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(ROUND_TRIP_CONFIG))
    settings = load_settings(config_path=path, environ={}).settings
    shown = redacted(settings)
    assert shown == with_defaults(ROUND_TRIP_CONFIG, tmp_path.resolve())
    assert settings_from_config(shown, base_dir=tmp_path.resolve()) == settings


def test_shipped_config_round_trips_including_repeated_fallbacks(repo_root: Path) -> None:
    """config.json gives managementIpAddress equal to ipAddress: shown as given, not as absent."""
    data = json.loads((repo_root / "config.json").read_text())
    shown = redacted(load_settings(config_path=repo_root / "config.json", environ={}).settings)
    assert shown == with_defaults(data, repo_root.resolve())
    assert shown["ServerConfig"]["managementIpAddress"] == "127.0.0.1"


def test_secrets_are_redacted_where_set(tmp_path: Path) -> None:
    config = {
        "SecurityConfig": {"apiKeys": ["sk-1"]},
        "ServerConfig": {"tlsPkPwd": "pw", "metricsTlsPkPwd": "pw2"},
    }
    shown = redacted(settings_from_config(config, base_dir=tmp_path))
    assert shown["SecurityConfig"] == {"apiKeys": "***", "adminKeys": []}
    server = shown["ServerConfig"]
    assert (server["tlsPkPwd"], server["managementTlsPkPwd"], server["metricsTlsPkPwd"]) == (
        "***", None, "***"
    )


def test_the_grpc_listener_is_off_without_a_port_and_falls_back_to_the_data_listener(
    tmp_path: Path,
) -> None:
    off = settings_from_config({}, base_dir=tmp_path).server.grpc
    assert off.port is None
    config = {"ServerConfig": {"ipAddress": "10.0.0.5", "grpcPort": 8001,
                               "tlsCert": "/x/server.pem", "grpcTlsPk": "/g/server.key"}}
    grpc = settings_from_config(config, base_dir=tmp_path).server.grpc
    assert (grpc.host, grpc.port) == ("10.0.0.5", 8001)
    assert (grpc.tls.cert, grpc.tls.key) == ("/x/server.pem", "/g/server.key")
    shown = redacted(settings_from_config(config, base_dir=tmp_path))["ServerConfig"]
    assert (shown["grpcPort"], shown["grpcIpAddress"], shown["grpcTlsPk"]) == (
        8001, None, "/g/server.key"
    )
