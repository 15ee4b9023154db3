"""An in-process gateway on the fake engine, driven through its listener apps (no sockets)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from starlette.types import Scope

from server.engines.fake import FakeEngine, FakeScript
from server.gateway import Gateway, build_gateway
from server.http.app import (
    Fallback,
    ListenerApp,
    fastapi_method_not_allowed,
    fastapi_not_found,
)
from server.http.auth import Keyring
from server.http.router import Router
from server.http.routes import Access, Route
from server.settings import settings_from_config
from tests.serverproc import merge
from tests.unit.demo_kit import unit_demo

ROOT = Path(__file__).resolve().parents[2]


def make_gateway(
    script: FakeScript | None = None,
    *,
    ready: bool = True,
    overrides: dict[str, Any] | None = None,
    model_path: Path | None = None,
) -> Gateway:
    """`model_path`: a model folder of the fake engine's (e.g. one with generation_config.json)."""
    model = model_path or unit_demo() / "model"
    config: dict[str, Any] = {
        "engine": "fake",
        "ModelConfig": {"modelName": "tiny", "modelWeightPath": str(model)},
        "LoraConfig": {"adapterDir": None},
        "LimitsConfig": {"maxConcurrentRequests": 4, "maxQueue": 2, "drainTimeout": 5},
        "ServerConfig": {"drainDelay": 0},  # tests of the lame-duck period set their own
    }
    settings = settings_from_config(merge(config, overrides or {}), base_dir=ROOT)
    engine = FakeEngine(script, model_name="tiny", model_path=str(model) if model_path else None)
    gateway = build_gateway(settings, engine)
    if ready:
        gateway.lifecycle.ready()
    return gateway


def client(gateway: Gateway, *roles: str) -> httpx.AsyncClient:
    app = gateway.app(roles or ("management",))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


class _NoMetrics:
    def response(
        self, scope: Scope, owner: str, endpoint: str, status: int, seconds: float
    ) -> None:
        pass


def routes_app(routes: Sequence[Route], *, max_body_bytes: int = 1 << 20) -> ListenerApp:
    """A data listener app serving just `routes` (one protocol's, in its translator tests)."""
    return ListenerApp(
        Router(routes, max_body_bytes=max_body_bytes),
        Fallback(
            render=routes[0].render,
            access=Access.DATA,
            not_found=fastapi_not_found,
            method_not_allowed=fastapi_method_not_allowed,
        ),
        max_body_bytes=max_body_bytes,
        keyring=Keyring(),
        observer=_NoMetrics(),
        closing=lambda: False,
    )
