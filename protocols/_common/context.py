"""What every protocol's routes are built from: the service and the request bounds."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.core.service import InferenceService


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
class ProtocolContext:
    service: InferenceService
    max_body_bytes: int = 40 * 1024 * 1024
    bounds: RequestBounds = field(default_factory=RequestBounds)
    server_version: str = "0.1.0"
    created: int = 0  # server start, seconds since the epoch
    allow_runtime_lora: bool = True
