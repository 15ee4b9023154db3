"""An in-process gateway on the fake engine, driven through its listener apps (no sockets)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from server.engine.fake import FakeEngine, FakeScript
from server.gateway import Gateway, build_gateway, listener_app
from server.settings import settings_from_config
from tests.serverproc import merge

ROOT = Path(__file__).resolve().parents[2]


def make_gateway(
    script: FakeScript | None = None, *, ready: bool = True, overrides: dict[str, Any] | None = None
) -> Gateway:
    config: dict[str, Any] = {
        "engine": "fake",
        "ModelConfig": {"modelName": "tiny", "modelWeightPath": "build/demo/model"},
        "LoraConfig": {"adapterDir": None},
        "LimitsConfig": {"maxConcurrentRequests": 4, "maxQueue": 2, "drainTimeout": 5},
    }
    settings = settings_from_config(merge(config, overrides or {}), base_dir=ROOT)
    gateway = build_gateway(settings, FakeEngine(script, model_name="tiny"))
    if ready:
        gateway.lifecycle.ready()
    return gateway


def client(gateway: Gateway, *roles: str) -> httpx.AsyncClient:
    app = listener_app(gateway, roles or ("management",))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
