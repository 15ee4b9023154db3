"""Run the gateway with its metrics switched off, to price them (scenario B).

The product has no switch for this (metrics are always on), so the benchmark swaps, in this
process only, the request observer for the core's `NullObserver` and the HTTP metrics middleware
for a pass-through, then runs the normal command line. Everything else is the product unchanged.
Run: `python -m bench.gateway_variant --no-metrics --config FILE`.
"""

from __future__ import annotations

import sys
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send


class _PassThrough:
    def __init__(self, app: ASGIApp, **_: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def _without_metrics() -> None:
    import server.gateway
    import server.runtime
    from server.core.service import NullObserver

    original = server.gateway.build_gateway

    def build_gateway(*args: Any, **kwargs: Any) -> Any:
        kwargs["observer"] = NullObserver()
        return original(*args, **kwargs)

    server.runtime.build_gateway = build_gateway  # type: ignore[assignment]
    server.gateway.HttpMetricsMiddleware = _PassThrough  # type: ignore[assignment,misc]


def main() -> int:
    argv = sys.argv[1:]
    if "--no-metrics" in argv:
        argv.remove("--no-metrics")
        _without_metrics()
    from server.cli import main as gateway_main

    return gateway_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
