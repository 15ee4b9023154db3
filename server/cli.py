"""Command line: argv + environment → Settings → serve(). The only reader of os.environ."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvloop

from server.core.lifecycle import log_phase
from server.engines.factory import create_engine
from server.observability.logs import configure_logging, log_settings
from server.runtime.limits import UnsupportedUvicorn
from server.runtime.placement import Standalone
from server.runtime.process import serve
from server.runtime.workers import supervise
from server.settings import SettingsError, load_settings, redacted

logger = logging.getLogger("gateway")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llm-gateway", description=__doc__)
    parser.add_argument("--config", type=Path, default=None, help="config.json (MindIE names)")
    parser.add_argument("--properties", type=Path, default=None, help="DJL serving.properties")
    parser.add_argument("--engine", choices=["vllm", "fake"], default=None)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting, e.g. --set ServerConfig.port=8000",
    )
    return parser.parse_args(argv)


def cli_layer(args: argparse.Namespace) -> dict[str, Any]:
    layer: dict[str, Any] = {}
    if args.engine:
        layer["engine"] = args.engine
    for item in args.set:
        key, _, value = item.partition("=")
        node = layer
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _scalar(value)
    return layer


def _scalar(value: str) -> Any:
    import json

    try:
        return json.loads(value)
    except ValueError:
        return value


def engine_environment(kv_cache_gib: int, *, json_logs: bool = False) -> dict[str, str]:
    """vLLM reads these at import; defaults suited to CPU hosts, never overriding the operator.

    With JSON logs, vLLM leaves its loggers to ours, so its lines are JSON with the request id
    too (the engine-core child process then logs only warnings, in plain text)."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
    }
    if json_logs:
        env["VLLM_CONFIGURE_LOGGING"] = "0"
    return env


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    config_path = args.config
    if config_path is None and os.environ.get("GATEWAY_CONFIG"):
        config_path = Path(os.environ["GATEWAY_CONFIG"])
    try:
        loaded = load_settings(
            config_path=config_path,
            properties_path=args.properties,
            environ=os.environ,
            cli=cli_layer(args),
        )
    except SettingsError as exc:
        sys.stderr.write(f"llm-gateway: configuration error:\n{exc}\n")
        return 2
    settings = loaded.settings
    configure_logging(settings.logging.level, json_format=settings.logging.json_format)
    json_logs = settings.logging.json_format
    for key, value in engine_environment(
        settings.model.kv_cache_space_gib, json_logs=json_logs
    ).items():
        os.environ.setdefault(key, value)
    log_settings(logger, redacted(settings), loaded.provenance, json_format=json_logs)
    log_phase(logger, "settings", started)
    try:
        if settings.server.workers > 1:
            return supervise(settings, started)
        return uvloop.run(serve(settings, create_engine, Standalone(), started=started))
    except SettingsError as exc:
        sys.stderr.write(f"llm-gateway: configuration error:\n{exc}\n")
        return 2
    except UnsupportedUvicorn as exc:
        sys.stderr.write(f"llm-gateway: {exc}\n")
        return 2
