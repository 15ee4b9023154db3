"""Logging: plain or JSON lines, the request id on every line; the per-request log."""

from __future__ import annotations

import json
import logging
import time

from server.core.stream import Timing
from server.core.types import ChatPrompt, GenerationRequest, TextPrompt, Usage
from server.http.context import request_id_var

request_logger = logging.getLogger("gateway.requests")
PROMPT_LOG_CHARS = 2000


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, *, json_format: bool) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    if json_format:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class RequestLog:
    """One line per generation when admitted and one when it ends (or is refused).

    Prompts are never logged unless `log_prompts` (LoggingConfig.logPrompts) is set. Lines are
    INFO when the access log is on, else DEBUG; the request id comes from the context.
    """

    def __init__(self, *, log_prompts: bool = False, level: int = logging.DEBUG) -> None:
        self.log_prompts = log_prompts
        self.level = level

    def admitted(self, request: GenerationRequest) -> None:
        if not request_logger.isEnabledFor(self.level):
            return
        request_logger.log(
            self.level,
            "admitted protocol=%s model=%s stream=%s max_new_tokens=%s%s",
            request.protocol,
            request.model or "-",
            request.stream,
            request.sampling.max_new_tokens,
            self._prompt(request),
        )

    def finished(
        self,
        request: GenerationRequest,
        *,
        error_type: str | None,
        usage: Usage | None,
        timing: Timing,
    ) -> None:
        if not request_logger.isEnabledFor(self.level):
            return
        ttft = f"{timing.first_token_s * 1000:.1f}" if timing.first_token_s is not None else "-"
        request_logger.log(
            self.level,
            "finished protocol=%s outcome=%s prompt_tokens=%s completion_tokens=%s ttft_ms=%s "
            "seconds=%.3f",
            request.protocol,
            error_type or "ok",
            usage.prompt_tokens if usage else "-",
            usage.completion_tokens if usage else "-",
            ttft,
            timing.seconds,
        )

    def rejected(self, request: GenerationRequest, error_type: str) -> None:
        request_logger.log(
            self.level, "refused protocol=%s error_type=%s", request.protocol, error_type
        )

    def _prompt(self, request: GenerationRequest) -> str:
        if not self.log_prompts:
            return ""
        prompt = request.prompt
        if isinstance(prompt, TextPrompt):
            text = prompt.text
        elif isinstance(prompt, ChatPrompt):
            text = " | ".join(f"{m.role}: {m.content}" for m in prompt.messages)
        else:
            text = " ".join(str(t) for t in prompt.token_ids)
        return f" prompt={text[:PROMPT_LOG_CHARS]!r}"
