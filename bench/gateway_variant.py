"""The gateway's own command line with benchmark-only switches, each changing one thing:

  --no-metrics     the request observer becomes the core's `NullObserver` and the HTTP
                   observer a no-op (prices the metrics: scenario B; the product has no such
                   switch);
  --gc-log FILE    log every garbage-collector pause of 10 ms or more as a JSON line (wall-clock
                   end time, generation, milliseconds): passive, to find stalls in scenario A;
  --gc-freeze      `gc.collect()` + `gc.freeze()` when the server turns ready, as vLLM's own API
                   server does (`freeze_gc_heap`): the diagnostic arm of scenario A.

Run: `python -m bench.gateway_variant [switches] --config FILE`. Everything else is the product.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any

_PAUSE_MS = 10.0


def _without_metrics() -> None:
    import server.runtime.process
    from server.core.stream import NullObserver
    from server.observability.metrics import GatewayMetrics

    original = server.runtime.process.build_gateway  # type: ignore[attr-defined]

    def build_gateway(*args: Any, **kwargs: Any) -> Any:
        kwargs["observer"] = NullObserver()
        return original(*args, **kwargs)

    def no_response(self: GatewayMetrics, *args: Any) -> None:
        return None

    server.runtime.process.build_gateway = build_gateway  # type: ignore[attr-defined]
    GatewayMetrics.response = no_response  # type: ignore[method-assign,assignment]


def _log_gc(path: str) -> None:
    sink = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    started: list[float] = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            started[0] = now
            return
        pause_ms = (now - started[0]) * 1000
        if pause_ms >= _PAUSE_MS:
            row = {"t": time.time(), "gen": info["generation"], "ms": round(pause_ms, 1)}
            sink.write(json.dumps(row) + "\n")

    gc.callbacks.append(callback)


def _freeze_when_ready() -> None:
    from server.core.lifecycle import Lifecycle

    ready = Lifecycle.ready

    def freeze_then_ready(self: Lifecycle) -> None:
        gc.collect()
        gc.freeze()
        ready(self)

    Lifecycle.ready = freeze_then_ready  # type: ignore[method-assign]


def _take(argv: list[str], flag: str, with_value: bool = False) -> str | bool | None:
    if flag not in argv:
        return None
    index = argv.index(flag)
    argv.pop(index)
    return argv.pop(index) if with_value else True


def main() -> int:
    argv = sys.argv[1:]
    if _take(argv, "--no-metrics"):
        _without_metrics()
    gc_log = _take(argv, "--gc-log", with_value=True)
    if isinstance(gc_log, str):
        _log_gc(gc_log)
    if _take(argv, "--gc-freeze"):
        _freeze_when_ready()
    from server.cli import main as gateway_main

    return gateway_main(argv)


if __name__ == "__main__":  # vLLM spawns its engine core: never run this on import
    raise SystemExit(main())
