"""What every protocol's routes are built from (the service, request bounds, its options, the
server port), and the per-request context the listener app keeps (request id, scope keys)."""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from server.core.lifecycle import Shutdown
from server.core.service import InferenceService

Options = TypeVar("Options")
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
MAX_REQUEST_ID = 256  # a longer X-Request-Id is replaced, not echoed
_PREFIX = secrets.token_hex(8)
_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """32 hex digits, unique in this process and unguessable across processes (a uuid4 costs
    more than the rest of the request's bookkeeping)."""
    return f"{_PREFIX}{next(_COUNTER):016x}"


def current_request_id() -> str:
    """The id of the request being served: the client's `X-Request-Id`, or a new one."""
    return request_id_var.get()


@dataclass(slots=True)
class AccessNote:
    """What a request's generations add to its access-log line (one note per HTTP request,
    shared by reference with the tasks that serve it)."""

    adapter: str = "-"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_s: float | None = None

    def add(
        self, adapter: str | None, prompt_tokens: int, completion_tokens: int,
        first_token_s: float | None,
    ) -> None:
        """One generation of the request ended (a batch request has several)."""
        if adapter:
            self.adapter = adapter
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if first_token_s is not None and self.first_token_s is None:
            self.first_token_s = first_token_s


access_note_var: contextvars.ContextVar[AccessNote | None] = contextvars.ContextVar(
    "access_note", default=None
)


# Keys the listener app and the protocols share in the ASGI scope.
BODY_KEY = "gateway.body"  # set when a shared path's dispatcher already read the body
BODY_ERROR_KEY = "gateway.body_error"  # the error reading it raised, for the route to report
ADMIN_KEY = "gateway.admin"  # whether the caller holds an admin key; absent without keys
OWNER_KEY = "gateway.owner"  # the protocol a shared path's dispatcher chose, for the metrics
CLIENT_ID_KEY = "gateway.client_id"  # the client's usable X-Request-Id, else None


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestBounds:
    """Caps applied before the engine sees a request (CVE-2026-34756 class: unbounded n)."""

    max_n: int = 16
    max_best_of: int = 16
    max_stop_sequences: int = 16
    max_stop_length: int = 1024
    max_logprobs: int = 20
    max_top_n_tokens: int = 5
    max_new_tokens: int | None = None  # None: the context length is the cap
    max_prompts: int = 64  # prompts in one request (lists of prompts, DJL batches)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigFacts:
    """The configuration a protocol's control routes may report: the served model, the KV cache
    size, the parallel world size, and the resolved settings (secrets redacted) as the operator
    writes them."""

    model_name: str
    model_path: str  # the served base model's directory, resolved
    kv_cache_gib: int
    world_size: int
    settings: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class LatencyWindows:
    """Moving means over each worker's last requests (pooled across workers), and the slots
    waiting for admission in every worker."""

    ttft_s: float  # time to first token
    tbt_s: float  # time between tokens
    queued: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerPort:
    """What a protocol's management and metrics routes reach in the server beyond the service
    (the role and the state are the service's lifecycle)."""

    shutdown: Shutdown  # a graceful (or forced) stop, and the event set once drained
    config: ConfigFacts
    latency: Callable[[], LatencyWindows]  # the metrics view
    management_address: str  # host:port of the management listener


@dataclass(frozen=True, slots=True, kw_only=True)
class ProtocolContext:
    service: InferenceService
    max_body_bytes: int = 40 * 1024 * 1024
    bounds: RequestBounds = field(default_factory=RequestBounds)
    server_version: str = "0.1.0"
    created: int = 0  # server start, seconds since the epoch
    allow_runtime_lora: bool = True
    # the settings protocols declare they read (ProtocolSpec.options), by field name
    options: Mapping[str, Any] = field(default_factory=dict)
    server: ServerPort | None = None  # None: no management routes (a context built in a test)


def options_of(kind: type[Options], ctx: ProtocolContext) -> Options:
    """A protocol's typed options (a dataclass whose fields name the settings it reads) from
    the context; a setting the context lacks keeps the field's default."""
    names = [f.name for f in dataclasses.fields(kind)]  # type: ignore[arg-type]
    return kind(**{name: ctx.options[name] for name in names if name in ctx.options})
