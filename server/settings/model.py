"""The internal settings model: snake_case, frozen, every value validated, nothing to resolve.

This is what the server reads. The config file's MindIE/DJL names are not known here:
`server.settings.loader` maps them onto these fields (its table `ALIASES`). The loader also
resolves every fallback before validation, so the management and metrics listeners carry their
own complete `host` and `tls`; readers never fall back to the data listener themselves.

Defaults and bounds are those of the config file documented in README (Configuration).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.core.adapter_records import AdapterLimits

LISTENER_ROLES = ("data", "management", "metrics", "grpc")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Tls(_Section):
    """TLS of one listener. Files are relative to `Settings.base_dir` unless absolute; CA and
    CRL file names are relative to `ca_path` and `crl_path`."""

    enabled: bool = True
    ca_path: str = "certs/"
    ca_files: list[str] = Field(default_factory=lambda: ["ca.pem"], min_length=1, max_length=3)
    cert: str = "certs/server.pem"
    key: str = "certs/server.key"
    key_password_file: str | None = None  # a file holding the key's password
    crl_path: str = "certs/"
    crl_files: list[str] = Field(default_factory=list, max_length=3)


class Listener(_Section):
    """One listening address and its TLS."""

    host: str
    port: int = Field(ge=0, le=65535)
    tls: Tls = Field(default_factory=Tls)


class GrpcListener(Listener):
    """The gRPC listener (Triton's GRPCInferenceService and grpc.health.v1): off without a port."""

    port: int | None = Field(None, ge=0, le=65535)  # type: ignore[assignment]


class ServerSettings(_Section):
    data: Listener = Field(default_factory=lambda: Listener(host="127.0.0.1", port=1025))
    management: Listener = Field(default_factory=lambda: Listener(host="127.0.0.1", port=1026))
    metrics: Listener = Field(default_factory=lambda: Listener(host="127.0.0.1", port=1027))
    grpc: GrpcListener = Field(default_factory=lambda: GrpcListener(host="127.0.0.1"))
    allow_all_zero_ip: bool = False
    max_links: int = Field(1000, ge=1, le=100_000)
    max_request_mb: int = Field(40, ge=1, le=100)  # MB, as MindIE
    max_header_bytes: int = Field(65_536, ge=1024)  # request line + headers → 431 beyond
    max_header_count: int = Field(100, ge=1)
    request_receive_timeout_s: float = Field(30.0, gt=0)  # whole request must arrive (slowloris)
    send_timeout_s: float = Field(60.0, gt=0)  # a client that reads nothing this long is dropped
    keep_alive_timeout_s: float = Field(5.0, gt=0)
    # front-end processes over one engine core (vLLM's --api-server-count): README, Scaling
    workers: int = Field(1, ge=1, le=64)
    # seconds a stopping server keeps serving new requests while readiness already fails (the
    # lame-duck period, before LimitsConfig.drainTimeout): docs/operations.md, Graceful stop
    drain_delay: float = Field(5.0, ge=0, le=3600)
    # what serves HTTP: uvicorn (default) or granian, a compiled server (the `granian` extra):
    # docs/operations.md, HTTP runner
    http_runner: Literal["uvicorn", "granian"] = "uvicorn"

    @property
    def max_request_bytes(self) -> int:
        """The request body limit in bytes (`max_request_mb` MiB)."""
        return self.max_request_mb * 1024 * 1024

    def listener(self, role: str) -> Listener:
        """The listener of `role`, one of LISTENER_ROLES; ValueError for any other name."""
        if role not in LISTENER_ROLES:
            raise ValueError(f"unknown listener {role!r}")
        listener: Listener = getattr(self, role)
        return listener


class ModelSettings(_Section):
    name: str = "tiny"
    weight_path: str = "build/demo/model"
    dtype: str = "float32"
    max_model_len: int | None = Field(512, ge=16)
    max_num_seqs: int = Field(32, ge=1)
    seed: int = 0
    enforce_eager: bool = True
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1)  # engine cores, vLLM balancing requests over them
    distributed_executor_backend: str | None = None
    kv_cache_space_gib: int = Field(1, ge=1)
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser name: tool_choice "auto"
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser name
    # more names that select the base model: TGI's own clients send "tgi", huggingface_hub's
    # InferenceClient(base_url=...) sends "dummy"
    aliases: list[str] = Field(default_factory=lambda: ["tgi", "dummy"])
    engine_options: dict[str, Any] = Field(default_factory=dict)  # any other AsyncEngineArgs


class AdapterEntry(_Section):
    name: str
    path: str
    pin: bool = False
    preload: bool = True


class LoraSettings(_Section):
    enabled: bool = True
    max_loras: int = Field(2, ge=1)
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 8
    max_cpu_loras: int | None = Field(4, ge=1)
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False
    adapter_dir: str | None = "build/demo/adapters"  # every sub-directory is registered at start
    adapter_roots: list[str] = Field(default_factory=list)  # where `src` may point; + adapter_dir
    adapters: list[AdapterEntry] = Field(default_factory=list)
    workflows: list[str] = Field(default_factory=list)  # DJL workflow.json files or folders
    allow_runtime_updates: bool = True
    # adapterDir as a live folder: an adapter folder dropped in serves on its first request
    # (on_demand) and the folder is rescanned every adapter_dir_refresh_s seconds (0 = never)
    on_demand: bool = True
    adapter_dir_refresh_s: float = Field(5.0, ge=0)
    state_file: str | None = None  # runtime registrations survive restarts when set
    # remote adapter sources: prefixes (s3://, https://…/{name}.tar.gz, hf://) where a request's
    # unknown adapter name is looked up on first use, the local cache of what was fetched, its
    # size budget, the time bound of one fetch (retries included) and the CA bundle for https
    adapter_sources: list[str] = Field(default_factory=list)
    adapter_cache_dir: str | None = None  # None: llm-gateway-<uid>/adapter-cache in temp
    adapter_cache_gib: float = Field(20.0, gt=0)
    adapter_source_timeout_s: float = Field(20.0, gt=0, le=600)
    adapter_source_ca_file: str | None = None
    # adapters composed per request (`merged_adapters`): where their folders are cached (None:
    # `merged-adapters` next to the state file, else in the system's temporary folder) and
    # how many stay registered at once (the least recently used idle one goes first)
    merged_adapter_dir: str | None = None
    max_merged_adapters: int = Field(32, ge=1)
    # adapter-aware admission (server/core/admission.py): at most max_active_adapters distinct
    # adapters in flight (None: max_cpu_loras, the adapters the engine holds loaded; 0: no
    # limit), each keeping its slot for adapter_cycle_s while others wait (LoRAX's
    # max_active_adapters and adapter_cycle_time_s); with fewer than max_cpu_loras, the next
    # ones are loaded ahead into the cached places left
    max_active_adapters: int | None = Field(None, ge=0)
    adapter_cycle_s: float = Field(2.0, gt=0, le=3600)

    @field_validator("adapter_sources")
    @classmethod
    def _known_schemes(cls, prefixes: list[str]) -> list[str]:
        for prefix in prefixes:
            if not prefix.startswith(("s3://", "https://", "hf://")):
                raise ValueError(f"adapter_sources entry {prefix!r} must start with s3://, "
                                 "https:// or hf://")
        return prefixes

    @model_validator(mode="after")
    def _cpu_cache_holds_slots(self) -> LoraSettings:
        """Cross-field check. Its message names the fields by their names in this section,
        whole words, so that the loader can put the config file's names in their place."""
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        cached = self.max_cpu_loras or self.max_loras
        if self.max_active_adapters is not None and self.max_active_adapters > cached:
            raise ValueError("max_active_adapters must be <= max_cpu_loras")
        pins = sum(1 for entry in self.adapters if entry.pin)
        most = AdapterLimits(enabled=True, max_loras=self.max_loras, max_cpu_loras=cached).max_pins
        if self.enabled and pins > most:  # else the start would serve without some of them
            raise ValueError(f"adapters: {pins} entries are pinned, at most {most} may be "
                             "(at most max_loras, and one place of max_cpu_loras stays unpinned)")
        return self


class LimitsSettings(_Section):
    max_concurrent_requests: int = Field(256, ge=1)
    max_queue: int = Field(512, ge=0)
    fair_admission: bool = True  # queue round-robin across adapters (False: one FIFO)
    queue_timeout_s: float = Field(60.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    drain_timeout_s: float = Field(30.0, ge=0)  # seconds in-flight requests get on stop
    engine_check_interval_s: float = Field(5.0, ge=0)  # engine liveness poll; 0 = off
    max_n: int = Field(16, ge=1)
    max_best_of: int = Field(16, ge=1)
    max_stop_sequences: int = Field(16, ge=1)
    max_logprobs: int = Field(20, ge=0)
    max_prompts_per_request: int = Field(64, ge=1)


class ProtocolSettings(_Section):
    """Switches that pick one anchor's variant where protocols share a shape (DJL's names)."""

    # DJL option.rolling_batch: "auto" is LMI's async mode and its output schema (LMI's default);
    # "vllm" (or "lmi-dist", which DJL maps to vllm) is the legacy rolling-batch schema
    rolling_batch: Literal["auto", "vllm", "lmi-dist"] = "auto"
    # DJL option.tgi_compat: SageMaker /invocations bodies with a string `inputs` answered by TGI
    tgi_compat: bool = False


class SecuritySettings(_Section):
    api_keys: list[str] = Field(default_factory=list)  # bearer keys for inference routes
    admin_keys: list[str] = Field(default_factory=list)  # bearer keys for management routes


class LoggingSettings(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    json_format: bool = False
    log_prompts: bool = False
    access_log: bool = False


class Settings(_Section):
    engine: Literal["vllm", "fake"] = "vllm"
    server: ServerSettings = Field(default_factory=ServerSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    protocols: ProtocolSettings = Field(default_factory=ProtocolSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    base_dir: str = "."  # where relative paths start; set by the loader
