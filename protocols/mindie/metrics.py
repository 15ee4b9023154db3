"""MindIE's `/metrics-json` on the metrics and management listeners: TTFT and TBT means
(integer ms) over the last 1000 requests (of each worker, pooled), waiting and processing
requests, free KV blocks; values are strings, `metric` a list. 503 once stopping or unhealthy,
as MindIE's status routes. The means come from the server's metrics view (`ServerPort.latency`).
"""

from __future__ import annotations

from starlette.requests import Request

from protocols.mindie import control
from server.core.service import InferenceService
from server.http.body import json_response
from server.http.context import ServerPort
from server.http.routes import MANAGEMENT, METRICS, Access, Answer, Doc, Route, RouteList

OWNER = "metrics"  # the metrics label and OpenAPI tag of the metrics routes


def metrics_json(service: InferenceService, server: ServerPort) -> object:
    stats = service.stats()
    own = server.latency()
    values = {
        "TTFT": round(own.ttft_s * 1000),
        "TBT": round(own.tbt_s * 1000),
        "waitingInferRequestNum": stats.waiting + own.queued,
        "processingInferRequestNum": stats.running,
        "remainBlocks": stats.free_blocks,
    }
    instance = server.management_address
    return {
        "resultType": "vector",
        "result": [
            {
                "metric": [{"__name__": name, "job": "node", "instance": instance}],
                "value": str(value),
            }
            for name, value in values.items()
        ],
    }


def routes(service: InferenceService, server: ServerPort) -> list[Route]:
    async def endpoint(request: Request) -> Answer:
        refusal = control.unavailable(service.lifecycle)
        if refusal is not None:
            return refusal
        return json_response(metrics_json(service, server))

    out = RouteList(
        owner=OWNER, render=control.render, access=Access.METRICS,
        listeners=frozenset({MANAGEMENT, METRICS}),
    )
    out.get("/metrics-json", endpoint, doc=Doc(summary="MindIE JSON metrics"))
    return out.routes
