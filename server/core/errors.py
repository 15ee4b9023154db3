"""Domain errors. Each carries a stable `error_type` (also the metrics label) and no HTTP.

Every protocol renders these through its own table in `protocols/<name>/errors.py`.
Messages are written for clients: never put a traceback or an internal path in one.
"""

from __future__ import annotations

import errno
from typing import ClassVar


class GatewayError(Exception):
    error_type: ClassVar[str] = "internal"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(GatewayError):
    """Malformed body, wrong type, value out of range: the client must change the request."""

    error_type = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    error_type = "context_length_exceeded"


class PayloadTooLarge(InvalidRequest):
    error_type = "payload_too_large"


class UnsupportedMediaType(InvalidRequest):
    error_type = "unsupported_media_type"


class Unsupported(InvalidRequest):
    """A known feature this server does not implement (e.g. TGI watermark)."""

    error_type = "unsupported"


class ModelNotFound(GatewayError):
    error_type = "model_not_found"

    def __init__(self, message: str, *, param: str | None = "model") -> None:
        super().__init__(message, param=param)


class AdapterNotFound(ModelNotFound):
    error_type = "adapter_not_found"


class RequestNotFound(GatewayError):
    """No running request has that id (stopInfer)."""

    error_type = "request_not_found"


class AdapterInvalid(InvalidRequest):
    """The adapter cannot be loaded as given: bad path, config, rank or weights, options that
    contradict each other (pin without preload), or the engine refused it."""

    error_type = "adapter_invalid"


class AdapterSourceMissing(AdapterInvalid):
    """Nothing that looks like an adapter is where its source points (no folder, no config)."""

    error_type = "adapter_invalid"


class AdapterExists(GatewayError):
    error_type = "adapter_exists"


class AdapterCapacity(GatewayError):
    """No engine slot left for another pinned adapter (DJL answers 507)."""

    error_type = "adapter_capacity"


class StateNotSaved(GatewayError):
    """A change of the adapter registry that could not be made durable (LoraConfig.stateFile
    cannot be written: disk full, read-only, no permission, folder gone). Nothing was changed.
    Answered 507 (Insufficient Storage) by the management routes."""

    error_type = "state_not_saved"

    @classmethod
    def from_os_error(cls, exc: OSError) -> StateNotSaved:
        reason = _STORAGE_REASONS.get(exc.errno or 0, exc.strerror or type(exc).__name__)
        return cls(
            f"The adapter change was not saved and nothing was changed: the adapter state file "
            f"(LoraConfig.stateFile) cannot be written ({reason}). Fix the storage and retry."
        )


_STORAGE_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "its folder does not exist",
    errno.EIO: "input/output error",
}


class LoraDisabled(InvalidRequest):
    error_type = "lora_disabled"


class Unauthorized(GatewayError):
    error_type = "unauthorized"


class Overloaded(GatewayError):
    """Admission refused: concurrency and queue are full. Retry later."""

    error_type = "overloaded"

    def __init__(self, message: str = "Model is overloaded", *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServiceUnavailable(GatewayError):
    """Starting, draining, stopped or the engine is dead."""

    error_type = "unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(GatewayError):
    error_type = "timeout"


class ClientClosed(GatewayError):
    """The client went away before its non-streamed answer; the engine request was aborted.
    Nobody reads the response (nginx's 499)."""

    error_type = "client_closed"


class EngineError(GatewayError):
    """The engine failed while generating."""

    error_type = "generation"
