"""vLLM's exceptions → the core's `GatewayError`s (nothing else escapes the engine)."""

from __future__ import annotations

import logging
import re

from server.core.errors import (
    AdapterCapacity,
    AdapterInvalid,
    AdapterNotFound,
    EngineError,
    GatewayError,
    InvalidRequest,
    Overloaded,
    ServiceUnavailable,
)
from server.core.types import AdapterHandle

logger = logging.getLogger("server.engines.vllm")

# vLLM wraps worker failures as "Call to add_lora method failed: Worker failed with error
# '<root cause>', please check the stack trace above for the root cause".
_WORKER_ERROR = re.compile(r"error '(?P<cause>.*)', please check", re.DOTALL)

_DEAD_MESSAGE = "engine is dead: the vLLM engine core stopped and the server must be restarted"


def to_gateway_error(exc: Exception) -> GatewayError:
    from vllm.exceptions import GracefulHTTPError, VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailable(_DEAD_MESSAGE)
    if isinstance(exc, GracefulHTTPError):
        return Overloaded(exc.message)
    if isinstance(exc, VLLMClientError | ValueError | TypeError):
        return InvalidRequest(_message(exc), param=getattr(exc, "parameter", None))
    logger.error("vLLM failed", exc_info=exc)
    return EngineError(f"the engine failed: {type(exc).__name__}")


def adapter_error(exc: Exception, adapter: AdapterHandle, engine_name: str) -> GatewayError:
    """The client's error for vLLM refusing `adapter`, which it knows as `engine_name`: the
    message names the adapter as the client does, not its path or engine name."""
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, EngineDeadError):
        return ServiceUnavailable(_DEAD_MESSAGE)
    logger.info("adapter %s refused by vLLM: %s", adapter.name, exc)
    text = str(exc)
    match = _WORKER_ERROR.search(text)
    cause = match.group("cause") if match else text.removeprefix("Call to add_lora method failed: ")
    if adapter.path:
        cause = cause.replace(adapter.path, f"'{adapter.name}'")
    return AdapterInvalid(cause.replace(engine_name, adapter.name), param="model")


def pin_error(exc: Exception, adapter: AdapterHandle) -> GatewayError:
    text = str(exc)
    if "No free" in text:
        return AdapterCapacity(f"no engine slot is left to pin LoRA adapter '{adapter.name}'.")
    if "not registered" in text or "not loaded" in text:
        return AdapterNotFound(f"LoRA adapter '{adapter.name}' is not loaded in the engine.")
    return to_gateway_error(exc)


def _message(exc: BaseException) -> str:
    """The message without vLLM's "(parameter=..., value=...)" suffix, nor the time and C++
    source place xgrammar puts before its own ("[14:46:55] /project/cpp/x.cc:83: ")."""
    first = exc.args[0] if exc.args else ""
    text = first if isinstance(first, str) and first else str(exc)
    return _NATIVE_PLACE.sub("", text).rstrip()


_NATIVE_PLACE = re.compile(r"\[\d{2}:\d{2}:\d{2}\] \S+\.(?:cc|cpp|h|hpp):\d+: ")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
