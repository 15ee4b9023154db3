"""The bare stack of scenario B: Starlette + uvicorn (same loop, parser and TLS as the gateway)
answering every captured route with the bytes the gateway sent for the same request.

The handler reads the body and replays the capture: a non-streamed body in one response, a
stream as one chunk per event from an async generator, i.e. the physical limit of the HTTP stack
for the same wire traffic. Run: `python -m bench.bare --capture FILE --port P [--tls]`;
`--granian`: the same app on granian's embedded server in a uvloop loop (one Rust thread,
HTTP/1.1, no lifespan), as `ServerConfig.httpRunner: "granian"` runs the gateway (plain HTTP).
"""

from __future__ import annotations

import argparse
import base64
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

CERTS = Path(__file__).resolve().parent.parent / "certs"


def _endpoint(entries: dict[str, dict[str, Any]]) -> Any:
    whole = entries.get("whole")
    stream = entries.get("stream")
    whole_body = base64.b64decode(whole["body"]) if whole else b""
    events = [base64.b64decode(e) for e in stream["events"]] if stream else []

    async def replay() -> AsyncIterator[bytes]:
        for event in events:
            yield event

    async def endpoint(request: Request) -> Response:
        body = await request.body()
        wants_stream = stream is not None and (whole is None or b'"stream":true' in body)
        if wants_stream:
            assert stream is not None
            return StreamingResponse(replay(), media_type=stream["content_type"])
        assert whole is not None
        return Response(whole_body, media_type=whole["content_type"])

    return endpoint


async def health(request: Request) -> Response:
    return Response(b"", status_code=200)


def build_app(capture: dict[str, dict[str, dict[str, Any]]]) -> Starlette:
    routes = [Route("/health", health, methods=["GET"])]
    routes += [
        Route(path, _endpoint(entries), methods=["POST"]) for path, entries in capture.items()
    ]
    return Starlette(routes=routes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--capture", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tls", action="store_true", help="mutual TLS with the dev certs")
    parser.add_argument("--granian", action="store_true", help="granian instead of uvicorn")
    args = parser.parse_args()
    app = build_app(json.loads(args.capture.read_text()))
    if args.granian:
        serve_granian(app, args.port)
        return
    tls: dict[str, Any] = {}
    if args.tls:
        tls = {
            "ssl_certfile": str(CERTS / "server.pem"),
            "ssl_keyfile": str(CERTS / "server.key"),
            "ssl_ca_certs": str(CERTS / "ca.pem"),
            "ssl_cert_reqs": ssl.CERT_REQUIRED,
        }
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="off",
        access_log=False,
        server_header=False,
        log_level="warning",
        **tls,
    )


def serve_granian(app: Starlette, port: int) -> None:
    import uvloop
    from granian.constants import HTTPModes, Interfaces
    from granian.log import LogLevels
    from granian.server.embed import Server

    server = Server(
        app, address="127.0.0.1", port=port, interface=Interfaces.ASGINL, http=HTTPModes.http1,
        websockets=False, backlog=1024, log_level=LogLevels.warning,
    )
    uvloop.run(server.serve())


if __name__ == "__main__":
    main()
