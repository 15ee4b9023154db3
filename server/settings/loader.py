"""Loading: layered sources, written in the config file's names → the internal `Settings`.

Precedence, lowest first: defaults < config.json < serving.properties < environment < CLI.
DJL documents serving.properties *over* environment variables; we put the environment above the
file on purpose, because env is how operators override a baked image.

Every layer speaks the config file's names: MindIE's `ServerConfig` names in config.json (so
MindIE users can bring theirs), `GATEWAY__SERVERCONFIG__PORT` and `--set LoraConfig.maxLoras=4`
for any key, DJL's `option.max_loras` / `OPTION_MAX_LORAS` for the engine keys DJL has. This
module is the only place those names exist: `ALIASES` maps each config path onto its field(s) of
`server.settings.model`, `FALLBACKS` fills the management/metrics listeners from the data
listener, and every error names the key as the user wrote it, the layer it came from and a fix.
Relative paths are resolved against the directory of config.json.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from server.settings.model import Listener, Settings, Tls

Tree = dict[str, Any]
Layer = tuple[str, Mapping[str, Any]]  # (source name, nested dict in the config file's names)

# Config path (as in config.json) → the internal field(s) it sets. Order is the config file's:
# `redacted` writes its keys in this order. `tlsCaPath` is the one key shared by all listeners.
ALIASES: Final[dict[str, tuple[str, ...]]] = {
    "engine": ("engine",),
    "ServerConfig.ipAddress": ("server.data.host",),
    "ServerConfig.port": ("server.data.port",),
    "ServerConfig.managementIpAddress": ("server.management.host",),
    "ServerConfig.managementPort": ("server.management.port",),
    "ServerConfig.metricsIpAddress": ("server.metrics.host",),
    "ServerConfig.metricsPort": ("server.metrics.port",),
    "ServerConfig.grpcIpAddress": ("server.grpc.host",),
    "ServerConfig.grpcPort": ("server.grpc.port",),
    "ServerConfig.allowAllZeroIpListening": ("server.allow_all_zero_ip",),
    "ServerConfig.httpsEnabled": ("server.data.tls.enabled",),
    "ServerConfig.tlsCaPath": (
        "server.data.tls.ca_path",
        "server.management.tls.ca_path",
        "server.metrics.tls.ca_path",
        "server.grpc.tls.ca_path",
    ),
    "ServerConfig.tlsCaFile": ("server.data.tls.ca_files",),
    "ServerConfig.tlsCert": ("server.data.tls.cert",),
    "ServerConfig.tlsPk": ("server.data.tls.key",),
    "ServerConfig.tlsPkPwd": ("server.data.tls.key_password_file",),
    "ServerConfig.tlsCrlPath": ("server.data.tls.crl_path",),
    "ServerConfig.tlsCrlFiles": ("server.data.tls.crl_files",),
    "ServerConfig.managementHttpsEnabled": ("server.management.tls.enabled",),
    "ServerConfig.managementTlsCaFile": ("server.management.tls.ca_files",),
    "ServerConfig.managementTlsCert": ("server.management.tls.cert",),
    "ServerConfig.managementTlsPk": ("server.management.tls.key",),
    "ServerConfig.managementTlsPkPwd": ("server.management.tls.key_password_file",),
    "ServerConfig.managementTlsCrlPath": ("server.management.tls.crl_path",),
    "ServerConfig.managementTlsCrlFiles": ("server.management.tls.crl_files",),
    "ServerConfig.metricsHttpsEnabled": ("server.metrics.tls.enabled",),
    "ServerConfig.metricsTlsCaFile": ("server.metrics.tls.ca_files",),
    "ServerConfig.metricsTlsCert": ("server.metrics.tls.cert",),
    "ServerConfig.metricsTlsPk": ("server.metrics.tls.key",),
    "ServerConfig.metricsTlsPkPwd": ("server.metrics.tls.key_password_file",),
    "ServerConfig.metricsTlsCrlPath": ("server.metrics.tls.crl_path",),
    "ServerConfig.metricsTlsCrlFiles": ("server.metrics.tls.crl_files",),
    "ServerConfig.grpcHttpsEnabled": ("server.grpc.tls.enabled",),
    "ServerConfig.grpcTlsCaFile": ("server.grpc.tls.ca_files",),
    "ServerConfig.grpcTlsCert": ("server.grpc.tls.cert",),
    "ServerConfig.grpcTlsPk": ("server.grpc.tls.key",),
    "ServerConfig.grpcTlsPkPwd": ("server.grpc.tls.key_password_file",),
    "ServerConfig.grpcTlsCrlPath": ("server.grpc.tls.crl_path",),
    "ServerConfig.grpcTlsCrlFiles": ("server.grpc.tls.crl_files",),
    "ServerConfig.maxLinkNum": ("server.max_links",),
    "ServerConfig.maxRequestLength": ("server.max_request_mb",),
    "ServerConfig.maxHeaderBytes": ("server.max_header_bytes",),
    "ServerConfig.maxHeaderCount": ("server.max_header_count",),
    "ServerConfig.requestReceiveTimeout": ("server.request_receive_timeout_s",),
    "ServerConfig.sendTimeout": ("server.send_timeout_s",),
    "ServerConfig.keepAliveTimeout": ("server.keep_alive_timeout_s",),
    "ServerConfig.workers": ("server.workers",),
    "ServerConfig.drainDelay": ("server.drain_delay",),
    "ServerConfig.httpRunner": ("server.http_runner",),
    "ModelConfig.modelName": ("model.name",),
    "ModelConfig.modelWeightPath": ("model.weight_path",),
    "ModelConfig.dtype": ("model.dtype",),
    "ModelConfig.maxModelLen": ("model.max_model_len",),
    "ModelConfig.maxNumSeqs": ("model.max_num_seqs",),
    "ModelConfig.seed": ("model.seed",),
    "ModelConfig.enforceEager": ("model.enforce_eager",),
    "ModelConfig.tensorParallelSize": ("model.tensor_parallel_size",),
    "ModelConfig.pipelineParallelSize": ("model.pipeline_parallel_size",),
    "ModelConfig.dataParallelSize": ("model.data_parallel_size",),
    "ModelConfig.distributedExecutorBackend": ("model.distributed_executor_backend",),
    "ModelConfig.kvCacheSpaceGiB": ("model.kv_cache_space_gib",),
    "ModelConfig.toolCallParser": ("model.tool_call_parser",),
    "ModelConfig.reasoningParser": ("model.reasoning_parser",),
    "ModelConfig.aliases": ("model.aliases",),
    "ModelConfig.engineOptions": ("model.engine_options",),
    "LoraConfig.enabled": ("lora.enabled",),
    "LoraConfig.maxLoras": ("lora.max_loras",),
    "LoraConfig.maxActiveAdapters": ("lora.max_active_adapters",),
    "LoraConfig.adapterCycleTime": ("lora.adapter_cycle_s",),
    "LoraConfig.maxLoraRank": ("lora.max_lora_rank",),
    "LoraConfig.maxCpuLoras": ("lora.max_cpu_loras",),
    "LoraConfig.loraDtype": ("lora.lora_dtype",),
    "LoraConfig.fullyShardedLoras": ("lora.fully_sharded_loras",),
    "LoraConfig.adapterDir": ("lora.adapter_dir",),
    "LoraConfig.adapterRoots": ("lora.adapter_roots",),
    "LoraConfig.adapters": ("lora.adapters",),  # entries keep their names: name, path, pin, preload
    "LoraConfig.workflows": ("lora.workflows",),
    "LoraConfig.allowRuntimeUpdates": ("lora.allow_runtime_updates",),
    "LoraConfig.onDemand": ("lora.on_demand",),
    "LoraConfig.adapterDirRefresh": ("lora.adapter_dir_refresh_s",),
    "LoraConfig.stateFile": ("lora.state_file",),
    "LoraConfig.adapterSources": ("lora.adapter_sources",),
    "LoraConfig.adapterCacheDir": ("lora.adapter_cache_dir",),
    "LoraConfig.adapterCacheGiB": ("lora.adapter_cache_gib",),
    "LoraConfig.adapterSourceTimeout": ("lora.adapter_source_timeout_s",),
    "LoraConfig.adapterSourceCaFile": ("lora.adapter_source_ca_file",),
    "LoraConfig.mergedAdapterDir": ("lora.merged_adapter_dir",),
    "LoraConfig.maxMergedAdapters": ("lora.max_merged_adapters",),
    "LimitsConfig.maxConcurrentRequests": ("limits.max_concurrent_requests",),
    "LimitsConfig.maxQueue": ("limits.max_queue",),
    "LimitsConfig.fairAdmission": ("limits.fair_admission",),
    "LimitsConfig.queueTimeout": ("limits.queue_timeout_s",),
    "LimitsConfig.requestTimeout": ("limits.request_timeout_s",),
    "LimitsConfig.drainTimeout": ("limits.drain_timeout_s",),
    "LimitsConfig.engineCheckInterval": ("limits.engine_check_interval_s",),
    "LimitsConfig.maxN": ("limits.max_n",),
    "LimitsConfig.maxBestOf": ("limits.max_best_of",),
    "LimitsConfig.maxStopSequences": ("limits.max_stop_sequences",),
    "LimitsConfig.maxLogprobs": ("limits.max_logprobs",),
    "LimitsConfig.maxPromptsPerRequest": ("limits.max_prompts_per_request",),
    "ProtocolConfig.rollingBatch": ("protocols.rolling_batch",),
    "ProtocolConfig.tgiCompat": ("protocols.tgi_compat",),
    "SecurityConfig.apiKeys": ("security.api_keys",),
    "SecurityConfig.adminKeys": ("security.admin_keys",),
    "LoggingConfig.level": ("logging.level",),
    "LoggingConfig.json_format": ("logging.json_format",),
    "LoggingConfig.logPrompts": ("logging.log_prompts",),
    "LoggingConfig.accessLog": ("logging.access_log",),
    "base_dir": ("base_dir",),  # always overwritten by the loader with config.json's folder
}

_DERIVED = ("management", "metrics", "grpc")  # the listeners that FALLBACKS fill
_TLS_FALLBACK_FIELDS = ("enabled", "ca_files", "cert", "key", "key_password_file", "crl_path",
                        "crl_files")
# (field, field it repeats when unset), applied in this order. Unset means absent or null; for a
# host also "" (MindIE: `managementIpAddress or ipAddress`).
FALLBACKS: Final[tuple[tuple[str, str], ...]] = (
    ("server.management.host", "server.data.host"),
    ("server.metrics.host", "server.management.host"),
    ("server.grpc.host", "server.data.host"),
    *(
        (f"server.{role}.tls.{name}", f"server.data.tls.{name}")
        for role in _DERIVED
        for name in _TLS_FALLBACK_FIELDS
    ),
)
_EMPTY_IS_UNSET = frozenset(
    {"server.management.host", "server.metrics.host", "server.grpc.host"}
)

# DJL serving.properties `option.*` / OPTION_* keys and the config path each sets; any other
# option goes into ModelConfig.engineOptions.
DJL_OPTIONS: Final[dict[str, str]] = {
    "enable_lora": "LoraConfig.enabled",
    "max_loras": "LoraConfig.maxLoras",
    "max_lora_rank": "LoraConfig.maxLoraRank",
    "max_cpu_loras": "LoraConfig.maxCpuLoras",
    "lora_dtype": "LoraConfig.loraDtype",
    "fully_sharded_loras": "LoraConfig.fullyShardedLoras",
    "tensor_parallel_degree": "ModelConfig.tensorParallelSize",
    "pipeline_parallel_degree": "ModelConfig.pipelineParallelSize",
    "max_rolling_batch_size": "ModelConfig.maxNumSeqs",
    "model_id": "ModelConfig.modelWeightPath",
    "dtype": "ModelConfig.dtype",
    "max_model_len": "ModelConfig.maxModelLen",
    "seed": "ModelConfig.seed",
    "distributed_executor_backend": "ModelConfig.distributedExecutorBackend",
    "tool_call_parser": "ModelConfig.toolCallParser",
    "reasoning_parser": "ModelConfig.reasoningParser",
    "rolling_batch": "ProtocolConfig.rollingBatch",
    "tgi_compat": "ProtocolConfig.tgiCompat",
}
ENGINE_OPTIONS = "ModelConfig.engineOptions"
SECRET_KEYS = frozenset(
    {"tlsPkPwd", "managementTlsPkPwd", "metricsTlsPkPwd", "grpcTlsPkPwd", "apiKeys",
     "adminKeys"}
)


class SettingsError(ValueError):
    """A configuration problem, phrased as `source: path: problem. Fix: hint`."""


@dataclass(frozen=True, slots=True)
class LoadedSettings:
    settings: Settings
    provenance: dict[str, str]  # dotted config path (as the user wrote it) -> source that set it


# ---- entry points ------------------------------------------------------------------------------
def load_settings(
    *,
    config_path: Path | None,
    properties_path: Path | None = None,
    environ: Mapping[str, str],
    cli: Mapping[str, Any] | None = None,
) -> LoadedSettings:
    """Merge every layer and validate once. Raises SettingsError naming the key and a fix."""
    layers: list[Layer] = [
        ("config.json", read_json(config_path)),
        ("serving.properties", properties_layer(read_properties(properties_path))),
        ("environment", env_layer(environ)),
        ("command line", dict(cli or {})),
    ]
    base_dir = str(config_path.resolve().parent) if config_path else str(Path.cwd())
    return build_settings(layers, base_dir=base_dir)


def settings_from_config(
    config: Mapping[str, Any], *, base_dir: str | Path, source: str = "config.json"
) -> Settings:
    """Settings from one dict written like config.json (for tests and tools), through the same
    aliases, fallbacks and errors as `load_settings`."""
    return build_settings([(source, config)], base_dir=str(base_dir)).settings


def build_settings(layers: Sequence[Layer], *, base_dir: str) -> LoadedSettings:
    """Merge `layers` (lowest first), map them onto the model, fill the fallbacks, validate once.

    Raises SettingsError listing every problem, one per line, as
    `source: Section.key: problem. Fix: hint` with the key as the user wrote it."""
    tree: Tree = {}
    provenance: dict[str, str] = {}
    for source, layer in layers:
        _merge(tree, layer, source, provenance, prefix="")
    tree["base_dir"] = base_dir
    given: Tree = {}
    problems: list[_Problem] = []
    _flatten(tree, "", given, problems)
    values, origin = _to_internal(given)
    explicit = {target for target, _ in FALLBACKS if not _is_unset(target, values.get(target))}
    _apply_fallbacks(values, origin)
    settings: Settings | None = None
    try:
        settings = Settings.model_validate(_unflatten({**_defaults(), **values}))
    except ValidationError as exc:
        problems += [_translate(error, origin) for error in exc.errors(include_url=False)]
    if problems or settings is None:
        raise SettingsError(_report(problems, provenance))
    return LoadedSettings(settings=_mark_explicit(settings, explicit), provenance=provenance)


# ---- sources -----------------------------------------------------------------------------------
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
    """serving.properties → a layer: `option.*` keys (DJL_OPTIONS, else engineOptions), `engine`."""
    layer: dict[str, Any] = {}
    for key, value in pairs.items():
        if key.startswith("option."):
            _set_option(layer, key.removeprefix("option."), value)
        elif key == "engine":
            layer["engine"] = "fake" if value.lower() == "fake" else "vllm"
    return layer


def env_layer(environ: Mapping[str, str]) -> dict[str, Any]:
    """OPTION_* (as DJL) and GATEWAY__SECTION__KEY (any config path, case-insensitive)."""
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
        _set_path(layer, DJL_OPTIONS[key].split("."), _parse_scalar(value))
    else:
        _set_path(layer, [*ENGINE_OPTIONS.split("."), key], _parse_scalar(value))


def _match_case(parts: list[str]) -> list[str]:
    """Map GATEWAY__SERVERCONFIG__PORT onto ServerConfig.port (env names are upper case); parts
    below a key (engineOptions entries) or below an unknown name are kept as written."""
    out: list[str] = []
    for part in parts:
        names = _CONFIG_CHILDREN.get(".".join(out), ())
        out.append(next((name for name in names if name.lower() == part.lower()), part))
    return out


def _parse_scalar(value: str) -> Any:
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(value)
    except ValueError:
        return value


def _set_path(tree: dict[str, Any], path: Sequence[str], value: Any) -> None:
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
    """Deep-merge `layer` into `tree`; a key (a leaf of ALIASES, e.g. engineOptions) is replaced
    whole. Records the source of every value set."""
    for key, value in layer.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in ALIASES and isinstance(tree.get(key, {}), dict):
            _merge(tree.setdefault(key, {}), value, source, provenance, prefix=f"{path}.")
        else:
            tree[key] = value
            provenance[path] = source


# ---- config names → internal fields ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Problem:
    path: str  # config path as the user wrote it
    message: str
    hint: str
    keys: tuple[str, ...] = ()  # config paths whose sources to name; default: `path`


def _flatten(node: Mapping[str, Any], prefix: str, given: Tree, problems: list[_Problem]) -> None:
    """Collect `config path -> value` for every key of ALIASES in `node`; anything else is a
    problem (an unknown key, or a section that is not an object)."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        if path in ALIASES:
            given[path] = value
        elif path in _CONFIG_CHILDREN and isinstance(value, dict):
            _flatten(value, f"{path}.", given, problems)
        elif path in _CONFIG_CHILDREN:
            problems.append(_Problem(path, "Input should be a valid dictionary", _hint("")))
        else:
            problems.append(
                _Problem(path, "Extra inputs are not permitted", _hint("extra_forbidden"))
            )


def _to_internal(given: Mapping[str, Any]) -> tuple[Tree, dict[str, str]]:
    """(internal path -> value, internal path -> config path it came from)."""
    values: Tree = {}
    origin: dict[str, str] = {}
    for path, value in given.items():
        for target in ALIASES[path]:
            values[target] = value
            origin[target] = path
    return values, origin


def _apply_fallbacks(values: Tree, origin: dict[str, str]) -> None:
    """Give each unset FALLBACKS field its fallback's value and origin (so that an error in it is
    reported once, under the key the user wrote); with neither set, the model default applies."""
    for target, fallback in FALLBACKS:
        if not _is_unset(target, values.get(target)):
            continue
        values.pop(target, None)
        if fallback in values:
            values[target] = values[fallback]
            origin[target] = origin[fallback]


def _is_unset(path: str, value: Any) -> bool:
    return value is None or (value == "" and path in _EMPTY_IS_UNSET)


def _mark_explicit(settings: Settings, explicit: set[str]) -> Settings:
    """`settings` with the management/metrics listeners' `model_fields_set` holding only the
    FALLBACKS fields the user gave (plus `port`, `tls`): the others merely repeat their fallback.
    Values are unchanged; `redacted` uses this to show such keys as absent, as the file had them."""
    server = settings.server
    update = {role: _listener_marked(server.listener(role), role, explicit) for role in _DERIVED}
    return settings.model_copy(update={"server": server.model_copy(update=update)})


def _listener_marked(listener: Listener, role: str, explicit: set[str]) -> Listener:
    def given(prefix: str) -> set[str]:
        names = (path.removeprefix(prefix) for path in explicit if path.startswith(prefix))
        return {name for name in names if "." not in name}

    tls = Tls.model_construct(_fields_set=given(f"server.{role}.tls."), **dict(listener.tls))
    fields = {"port", "tls"} | given(f"server.{role}.")
    return type(listener).model_construct(
        _fields_set=fields, host=listener.host, port=listener.port, tls=tls
    )


def _defaults() -> Tree:
    """Every internal field's default, `internal path -> value` (listeners need all of theirs)."""
    dumped = Settings().model_dump()
    return {path: _get(dumped, path) for path in _INTERNAL_TO_CONFIG}


def _unflatten(flat: Mapping[str, Any]) -> Tree:
    tree: Tree = {}
    for path, value in flat.items():
        _set_path(tree, path.split("."), value)
    return tree


def _get(tree: Mapping[str, Any], path: str) -> Any:
    node: Any = tree
    for part in path.split("."):
        node = node[part]
    return node


# ---- errors ------------------------------------------------------------------------------------
def _translate(error: ErrorDetails, origin: Mapping[str, str]) -> _Problem:
    """A pydantic error on the internal model → a problem under the config path the user wrote."""
    loc = [str(part) for part in error["loc"]]
    depth = next(
        (n for n in range(len(loc), 0, -1) if ".".join(loc[:n]) in _INTERNAL_TO_CONFIG), 0
    )
    hint = _hint(error["type"])
    if depth:
        field_path = ".".join(loc[:depth])
        config = origin.get(field_path, _INTERNAL_TO_CONFIG[field_path])
        return _Problem(".".join([config, *loc[depth:]]), error["msg"], hint)
    node = ".".join(loc)  # a section: a cross-field check naming its fields
    message, keys = _config_names_in(error["msg"], node)
    return _Problem(_config_node(node), message, hint, keys)


def _config_names_in(message: str, node: str) -> tuple[str, tuple[str, ...]]:
    """`message` with the whole-word field names of section `node` in their config names, and
    the config paths it names."""
    names = {
        path.removeprefix(f"{node}."): config
        for path, config in _INTERNAL_TO_CONFIG.items()
        if path.startswith(f"{node}.") and "." not in path.removeprefix(f"{node}.")
    }
    if not names:
        return message, ()
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    mentioned = tuple(dict.fromkeys(names[m] for m in pattern.findall(message)))
    return pattern.sub(lambda m: names[m.group()].rsplit(".", 1)[-1], message), mentioned


def _config_node(node: str) -> str:
    """The config path of an internal section: the common prefix of its fields' config paths."""
    configs = [c.split(".") for p, c in _INTERNAL_TO_CONFIG.items() if p.startswith(f"{node}.")]
    common: list[str] = []
    for parts in zip(*configs, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common) or node


def _hint(error_type: str) -> str:
    if error_type == "extra_forbidden":
        return "remove the key or correct its spelling (see README, Configuration)"
    if error_type == "literal_error":
        return "use one of the allowed values above"
    return "give a value of the expected type and range"


def _report(problems: Sequence[_Problem], provenance: Mapping[str, str]) -> str:
    """One line per distinct problem, in the config file's order."""
    lines = [
        f"{_sources(p.keys or (p.path,), provenance)}: {p.path}: {p.message}. Fix: {p.hint}"
        for p in sorted(problems, key=lambda p: _rank(p.path))
    ]
    return "\n".join(dict.fromkeys(lines))


def _sources(paths: Sequence[str], provenance: Mapping[str, str]) -> str:
    found = [s for s in dict.fromkeys(_source(p, provenance) for p in paths) if s != "defaults"]
    return ", ".join(found) or "defaults"


def _source(path: str, provenance: Mapping[str, str]) -> str:
    """The layer that set `path`, or the one(s) that set keys below it, or above it."""
    if path in provenance:
        return provenance[path]
    below = [source for key, source in provenance.items() if key.startswith(f"{path}.")]
    if below:
        return ", ".join(dict.fromkeys(below))
    parts = path.split(".")
    for n in range(len(parts) - 1, 0, -1):
        if (above := ".".join(parts[:n])) in provenance:
            return provenance[above]
    return "defaults"


def _rank(path: str) -> tuple[int, int]:
    """Sort key: a section's known keys in ALIASES order, then its unknown keys."""
    parts = path.split(".")
    keys = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
    known = next((_ALIAS_RANK[k] for k in keys if k in _ALIAS_RANK), None)
    if known is not None:
        return known, 0
    section = _SECTION_LAST.get(parts[0], len(ALIASES))
    return section, 1


# ---- internal → config names -------------------------------------------------------------------
def redacted(settings: Settings) -> dict[str, Any]:
    """The settings in the config file's names and shape (every ALIASES key, in its order), for
    logs and /v1/config. A management/metrics key that was not given and only repeats its
    fallback is None, as when absent from the file; secrets (`*TlsPkPwd`, `apiKeys`,
    `adminKeys`) are "***" when set. Secrets aside, loading the result again gives the same
    settings."""
    flat = _flat_values(settings)
    tree: Tree = {}
    for path, targets in ALIASES.items():
        _set_path(tree, path.split("."), _shown(settings, flat, targets[0]))
    cleaned: dict[str, Any] = _redact(tree)
    return cleaned


def _flat_values(settings: Settings) -> Tree:
    dumped = settings.model_dump()
    return {path: _get(dumped, path) for path in _INTERNAL_TO_CONFIG}


def _shown(settings: Settings, flat: Mapping[str, Any], target: str) -> Any:
    """The value of internal field `target`, None for a fallback field that was not given and
    only repeats its fallback's value."""
    fallback = _FALLBACK_OF.get(target)
    if fallback is None or flat[target] != flat[fallback]:
        return flat[target]
    *parents, name = target.split(".")
    owner: BaseModel = settings
    for part in parents:
        owner = getattr(owner, part)
    return flat[target] if name in owner.model_fields_set else None


def _redact(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: ("***" if k in SECRET_KEYS and v else _redact(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_redact(v) for v in node]
    return node


def resolve_path(settings: Settings, path: str) -> str:
    """`path` if absolute or a URL (`s3://…`), else relative to the folder of config.json
    (`settings.base_dir`)."""
    if "://" in path:
        return path
    candidate = Path(path)
    return str(candidate if candidate.is_absolute() else Path(settings.base_dir) / candidate)


# ---- tables derived from ALIASES ---------------------------------------------------------------
def _children(paths: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Config node ("" for the top) -> the names directly below it, in ALIASES order."""
    children: dict[str, dict[str, None]] = {}
    for path in paths:
        parts = path.split(".")
        for n in range(len(parts)):
            children.setdefault(".".join(parts[:n]), {})[parts[n]] = None
    return {node: tuple(names) for node, names in children.items()}


_INTERNAL_TO_CONFIG: Final[dict[str, str]] = {
    target: path for path, targets in ALIASES.items() for target in targets
}
_CONFIG_CHILDREN: Final = _children(list(ALIASES))
_FALLBACK_OF: Final = dict(FALLBACKS)
_ALIAS_RANK: Final = {path: rank for rank, path in enumerate(ALIASES)}
_SECTION_LAST: Final = {path.split(".")[0]: rank for rank, path in enumerate(ALIASES)}
