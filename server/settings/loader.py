"""One typed Settings tree, loaded once by a pure function from layered sources.

Precedence, lowest first: defaults < config.json < serving.properties < environment < CLI.
DJL documents serving.properties *over* environment variables; we put the environment above the
file on purpose, because env is how operators override a baked image.

`config.json` uses MindIE's `ServerConfig` names where they exist, so MindIE users can bring theirs.
Relative paths are resolved against the directory of config.json.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSection(_Section):
    ipAddress: str = "127.0.0.1"
    port: int = Field(1025, ge=0, le=65535)
    managementIpAddress: str | None = None
    managementPort: int = Field(1026, ge=0, le=65535)
    metricsIpAddress: str | None = None
    metricsPort: int = Field(1027, ge=0, le=65535)
    allowAllZeroIpListening: bool = False
    httpsEnabled: bool = True
    tlsCaPath: str = "certs/"
    tlsCaFile: list[str] = Field(default_factory=lambda: ["ca.pem"], min_length=1, max_length=3)
    tlsCert: str = "certs/server.pem"
    tlsPk: str = "certs/server.key"
    tlsPkPwd: str | None = None  # a file holding the key's password
    tlsCrlPath: str = "certs/"
    tlsCrlFiles: list[str] = Field(default_factory=list, max_length=3)
    managementHttpsEnabled: bool | None = None
    managementTlsCaFile: list[str] | None = None
    managementTlsCert: str | None = None
    managementTlsPk: str | None = None
    managementTlsPkPwd: str | None = None
    managementTlsCrlPath: str | None = None
    managementTlsCrlFiles: list[str] | None = None
    metricsHttpsEnabled: bool | None = None
    metricsTlsCaFile: list[str] | None = None
    metricsTlsCert: str | None = None
    metricsTlsPk: str | None = None
    metricsTlsPkPwd: str | None = None
    metricsTlsCrlPath: str | None = None
    metricsTlsCrlFiles: list[str] | None = None
    maxLinkNum: int = Field(1000, ge=1, le=100_000)
    maxRequestLength: int = Field(40, ge=1, le=100)  # MB, as MindIE
    maxHeaderBytes: int = Field(65_536, ge=1024)  # request line + headers → 431 beyond
    maxHeaderCount: int = Field(100, ge=1)
    requestReceiveTimeout: float = Field(30.0, gt=0)  # whole request must arrive within (slowloris)
    sendTimeout: float = Field(60.0, gt=0)  # a client that reads nothing this long is dropped
    keepAliveTimeout: float = Field(5.0, gt=0)


class ModelSection(_Section):
    modelName: str = "tiny"
    modelWeightPath: str = "build/demo/model"
    dtype: str = "float32"
    maxModelLen: int | None = Field(512, ge=16)
    maxNumSeqs: int = Field(32, ge=1)
    seed: int = 0
    enforceEager: bool = True
    tensorParallelSize: int = Field(1, ge=1)
    pipelineParallelSize: int = Field(1, ge=1)
    distributedExecutorBackend: str | None = None
    kvCacheSpaceGiB: int = Field(1, ge=1)
    engineOptions: dict[str, Any] = Field(default_factory=dict)


class AdapterEntry(_Section):
    name: str
    path: str
    pin: bool = False
    preload: bool = True


class LoraSection(_Section):
    enabled: bool = True
    maxLoras: int = Field(2, ge=1)
    maxLoraRank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 8
    maxCpuLoras: int | None = Field(4, ge=1)
    loraDtype: str = "auto"
    fullyShardedLoras: bool = False
    adapterDir: str | None = "build/demo/adapters"  # every sub-directory is registered at start
    adapterRoots: list[str] = Field(default_factory=list)  # where `src` may point; + adapterDir
    adapters: list[AdapterEntry] = Field(default_factory=list)
    workflows: list[str] = Field(default_factory=list)  # DJL workflow.json files or folders
    allowRuntimeUpdates: bool = True

    @model_validator(mode="after")
    def _cpu_cache_holds_slots(self) -> LoraSection:
        if self.maxCpuLoras is not None and self.maxCpuLoras < self.maxLoras:
            raise ValueError("maxCpuLoras must be >= maxLoras")
        return self


class LimitsSection(_Section):
    maxConcurrentRequests: int = Field(256, ge=1)
    maxQueue: int = Field(512, ge=0)
    queueTimeout: float = Field(60.0, gt=0)
    requestTimeout: float = Field(600.0, gt=0)
    drainTimeout: float = Field(30.0, ge=0)  # seconds in-flight requests get on stop
    engineCheckInterval: float = Field(5.0, ge=0)  # engine liveness poll; 0 = off
    maxN: int = Field(16, ge=1)
    maxBestOf: int = Field(16, ge=1)
    maxStopSequences: int = Field(16, ge=1)
    maxLogprobs: int = Field(20, ge=0)
    maxPromptsPerRequest: int = Field(64, ge=1)


class SecuritySection(_Section):
    apiKeys: list[str] = Field(default_factory=list)  # bearer keys for inference routes
    adminKeys: list[str] = Field(default_factory=list)  # bearer keys for management routes


class LoggingSection(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    json_format: bool = False
    logPrompts: bool = False
    accessLog: bool = False


class Settings(_Section):
    engine: Literal["vllm", "fake"] = "vllm"
    ServerConfig: ServerSection = Field(default_factory=ServerSection)
    ModelConfig: ModelSection = Field(default_factory=ModelSection)
    LoraConfig: LoraSection = Field(default_factory=LoraSection)
    LimitsConfig: LimitsSection = Field(default_factory=LimitsSection)
    SecurityConfig: SecuritySection = Field(default_factory=SecuritySection)
    LoggingConfig: LoggingSection = Field(default_factory=LoggingSection)
    base_dir: str = "."  # where relative paths start; set by the loader


class SettingsError(ValueError):
    """A configuration problem, phrased as `source: path: problem. Fix: hint`."""


@dataclass(frozen=True, slots=True)
class LoadedSettings:
    settings: Settings
    provenance: dict[str, str]  # dotted path -> source that set it


# DJL serving.properties / OPTION_* keys and where they land.
DJL_OPTIONS: dict[str, tuple[str, str]] = {
    "enable_lora": ("LoraConfig", "enabled"),
    "max_loras": ("LoraConfig", "maxLoras"),
    "max_lora_rank": ("LoraConfig", "maxLoraRank"),
    "max_cpu_loras": ("LoraConfig", "maxCpuLoras"),
    "lora_dtype": ("LoraConfig", "loraDtype"),
    "fully_sharded_loras": ("LoraConfig", "fullyShardedLoras"),
    "tensor_parallel_degree": ("ModelConfig", "tensorParallelSize"),
    "pipeline_parallel_degree": ("ModelConfig", "pipelineParallelSize"),
    "max_rolling_batch_size": ("ModelConfig", "maxNumSeqs"),
    "model_id": ("ModelConfig", "modelWeightPath"),
    "dtype": ("ModelConfig", "dtype"),
    "max_model_len": ("ModelConfig", "maxModelLen"),
    "seed": ("ModelConfig", "seed"),
    "distributed_executor_backend": ("ModelConfig", "distributedExecutorBackend"),
}
SECRET_KEYS = frozenset(
    {"tlsPkPwd", "managementTlsPkPwd", "metricsTlsPkPwd", "apiKeys", "adminKeys"}
)


def load_settings(
    *,
    config_path: Path | None,
    properties_path: Path | None = None,
    environ: Mapping[str, str],
    cli: Mapping[str, Any] | None = None,
) -> LoadedSettings:
    """Merge every layer and validate once. Raises SettingsError naming the field and a fix."""
    tree: dict[str, Any] = {}
    provenance: dict[str, str] = {}
    layers = [
        ("config.json", read_json(config_path)),
        ("serving.properties", properties_layer(read_properties(properties_path))),
        ("environment", env_layer(environ)),
        ("command line", dict(cli or {})),
    ]
    for source, layer in layers:
        _merge(tree, layer, source, provenance, prefix="")
    base_dir = str(config_path.resolve().parent) if config_path else str(Path.cwd())
    tree["base_dir"] = base_dir
    try:
        settings = Settings.model_validate(tree)
    except ValidationError as exc:
        raise _explain(exc, provenance) from None
    return LoadedSettings(settings=settings, provenance=provenance)


def read_json(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise SettingsError(
            f"{path}: cannot read: {exc.strerror}. Fix: pass --config PATH"
        ) from None
    except ValueError as exc:
        raise SettingsError(f"{path}: not valid JSON: {exc}. Fix: correct the syntax") from None
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: must hold a JSON object. Fix: wrap the settings in {{}}")
    return data


def read_properties(path: Path | None) -> dict[str, str]:
    if path is None or not path.exists():
        return {}
    pairs: dict[str, str] = {}
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", "!")) and "=" in stripped:
            key, value = stripped.split("=", 1)
            pairs[key.strip()] = value.strip()
    return pairs


def properties_layer(pairs: Mapping[str, str]) -> dict[str, Any]:
    layer: dict[str, Any] = {}
    for key, value in pairs.items():
        if key.startswith("option."):
            _set_option(layer, key.removeprefix("option."), value)
        elif key == "engine":
            layer["engine"] = "fake" if value.lower() == "fake" else "vllm"
    return layer


def env_layer(environ: Mapping[str, str]) -> dict[str, Any]:
    layer: dict[str, Any] = {}
    for key, value in environ.items():
        if key.startswith("OPTION_"):
            _set_option(layer, key.removeprefix("OPTION_").lower(), value)
        elif key.startswith("GATEWAY__"):
            path = key.removeprefix("GATEWAY__").split("__")
            _set_path(layer, _match_case(path), _parse_scalar(value))
    return layer


def _set_option(layer: dict[str, Any], key: str, value: str) -> None:
    if key in DJL_OPTIONS:
        section, field_name = DJL_OPTIONS[key]
        layer.setdefault(section, {})[field_name] = _parse_scalar(value)
    else:
        options = layer.setdefault("ModelConfig", {}).setdefault("engineOptions", {})
        options[key] = _parse_scalar(value)


def _match_case(path: list[str]) -> list[str]:
    """Map GATEWAY__SERVERCONFIG__PORT onto ServerConfig.port (env names are upper case)."""
    model: type[BaseModel] | None = Settings
    out = []
    for part in path:
        fields = model.model_fields if model else {}
        name = next((f for f in fields if f.lower() == part.lower()), part)
        out.append(name)
        annotation = fields[name].annotation if name in fields else None
        model = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )
    return out


def _parse_scalar(value: str) -> Any:
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(value)
    except ValueError:
        return value


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def _merge(
    tree: dict[str, Any],
    layer: Mapping[str, Any],
    source: str,
    provenance: dict[str, str],
    prefix: str,
) -> None:
    for key, value in layer.items():
        path = f"{prefix}{key}"
        if (
            isinstance(value, dict)
            and key != "engineOptions"
            and isinstance(tree.get(key, {}), dict)
        ):
            _merge(tree.setdefault(key, {}), value, source, provenance, prefix=f"{path}.")
        else:
            tree[key] = value
            provenance[path] = source


def _explain(exc: ValidationError, provenance: Mapping[str, str]) -> SettingsError:
    lines = []
    for error in exc.errors(include_url=False):
        path = ".".join(str(p) for p in error["loc"])
        source = provenance.get(path, "defaults")
        hint = _hint(error["type"])
        lines.append(f"{source}: {path}: {error['msg']}. Fix: {hint}")
    return SettingsError("\n".join(lines))


def _hint(error_type: str) -> str:
    if error_type == "extra_forbidden":
        return "remove the key or correct its spelling (see README, Configuration)"
    if error_type == "literal_error":
        return "use one of the allowed values above"
    return "give a value of the expected type and range"


def redacted(settings: Settings) -> dict[str, Any]:
    """The settings as a dict with secrets replaced, for logs and /v1/config."""
    cleaned: dict[str, Any] = _redact(settings.model_dump())
    return cleaned


def _redact(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: ("***" if k in SECRET_KEYS and v else _redact(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_redact(v) for v in node]
    return node


def resolve_path(settings: Settings, path: str) -> str:
    candidate = Path(path)
    return str(candidate if candidate.is_absolute() else Path(settings.base_dir) / candidate)
