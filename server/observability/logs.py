"""Logging: plain or JSON lines, the request id on every line; the settings one key per line;
the access line and the per-request log."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from starlette.types import Scope

from server.core.stream import Timing
from server.core.types import ChatPrompt, GenerationRequest, TextPrompt, Usage
from server.http.context import AccessNote, request_id_var

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
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, *, json_format: bool, process: str = "") -> None:
    """`process` names this process in plain-text lines (`worker-1` among several)."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    if json_format:
        handler.setFormatter(JsonFormatter())
    else:
        tag = f" {process}" if process else ""
        handler.setFormatter(
            logging.Formatter(
                f"%(asctime)s %(levelname)s %(name)s{tag} [%(request_id)s] %(message)s"
            )
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # uvicorn says "Started server process" / "Uvicorn running on" once per listener; the
    # gateway logs its listeners in one start-up line instead. Its warnings still show.
    logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, root.level))


def settings_lines(tree: Mapping[str, Any], sources: Mapping[str, str]) -> list[str]:
    """`Section.key = value (source)`, one per key of the resolved settings (leaves only,
    in the tree's order); keys no layer set are marked `default`."""
    lines: list[str] = []

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, Mapping) and value:
                walk(value, f"{path}.")
            else:
                shown = json.dumps(value, default=str)
                lines.append(f"{path} = {shown} ({sources.get(path, 'default')})")

    walk(tree, "")
    return lines


def log_settings(
    logger: logging.Logger, tree: Mapping[str, Any], sources: Mapping[str, str], *,
    json_format: bool,
) -> None:
    """The resolved settings: one line per key, or one JSON record with the whole tree."""
    if json_format:
        logger.info("settings", extra={"fields": {"settings": tree, "sources": sources}})
        return
    for line in settings_lines(tree, sources):
        logger.info("setting %s", line)


def access_line(
    scope: Scope, owner: str, route: str, status: int, seconds: float, note: AccessNote | None
) -> str:
    """One HTTP request: method, path, status, protocol, route template, and for generations
    the adapter, tokens and time to first token; then its duration."""
    head = f"{scope.get('method')} {scope.get('path')} {status} protocol={owner} route={route}"
    if note is not None and (note.prompt_tokens or note.completion_tokens):
        ttft = "-" if note.first_token_s is None else f"{note.first_token_s * 1000:.1f}"
        head += (
            f" adapter={note.adapter} prompt_tokens={note.prompt_tokens}"
            f" completion_tokens={note.completion_tokens} ttft_ms={ttft}"
        )
    return f"{head} ms={seconds * 1000:.1f}"


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
