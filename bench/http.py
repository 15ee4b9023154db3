"""A lean HTTP/1.1 client on raw asyncio streams: one keep-alive connection, one request at a time.

Why not httpx or aiohttp: on this 2-core box the load generator shares the CPU with the server,
and a general-purpose client spends more per request than the gateway does on small responses.
This client does the minimum a benchmark needs: write the request, read the status and headers,
then hand the body to the caller chunk by chunk (Content-Length or chunked) as it arrives, so
the caller can timestamp every streamed event.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

_READ_LIMIT = 1 << 22
# Sent with every request, next to Host and Content-Length (wrk's scripts add the same).
BASE_HEADERS = {"Content-Type": "application/json"}
_BASE_LINES = tuple(f"{k}: {v}".encode() for k, v in BASE_HEADERS.items())


class HttpError(Exception):
    """The connection broke or the server spoke something that is not HTTP/1.1."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where requests go: loopback only, plain HTTP or (m)TLS."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None

    @classmethod
    def parse(cls, url: str, tls: ssl.SSLContext | None = None) -> Target:
        scheme, _, rest = url.partition("://")
        hostport = rest.split("/", 1)[0]
        host, _, port = hostport.rpartition(":")
        if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
            raise ValueError(f"the load generator only talks to loopback, not {host!r}")
        if scheme == "https" and tls is None:
            raise ValueError("https needs a TLS context (--cacert/--cert/--key)")
        return cls(host=host.strip("[]"), port=int(port), tls=tls if scheme == "https" else None)


def client_tls(cafile: Path, certfile: Path | None, keyfile: Path | None) -> ssl.SSLContext:
    """A client context trusting `cafile`, presenting a client certificate when given (mTLS)."""
    context = ssl.create_default_context(cafile=str(cafile))
    context.check_hostname = False  # dev certs name 127.0.0.1/localhost; loopback anyway
    if certfile is not None:
        context.load_cert_chain(str(certfile), str(keyfile) if keyfile else None)
    return context


@dataclass(slots=True)
class Response:
    status: int
    headers: dict[str, str]
    connection: Connection
    _chunked: bool = False
    _remaining: int | None = None  # Content-Length left; None = until close
    _done: bool = False
    raw_body: bytearray = field(default_factory=bytearray)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (transfer chunks decoded)."""
        reader = self.connection.reader
        try:
            if self._chunked:
                async for chunk in _read_chunked(reader):
                    yield chunk
            elif self._remaining is not None:
                while self._remaining > 0:
                    chunk = await reader.read(min(self._remaining, 1 << 16))
                    if not chunk:
                        raise HttpError("connection closed inside the body")
                    self._remaining -= len(chunk)
                    yield chunk
            else:
                while chunk := await reader.read(1 << 16):
                    yield chunk
                self.connection.keep_alive = False
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            self.connection.keep_alive = False
            raise HttpError(f"body read failed: {exc!r}") from exc
        self._done = True

    async def read(self) -> bytes:
        body = bytearray()
        async for chunk in self.chunks():
            body += chunk
        return bytes(body)


async def _read_chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        line = await reader.readuntil(b"\r\n")
        size = int(line.split(b";", 1)[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                pass
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


class Connection:
    """One keep-alive connection. Not safe for concurrent requests (one at a time, by design)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter | None = None
        self.keep_alive = False
        self._host_header = f"{target.host}:{target.port}".encode()

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(
            self.target.host, self.target.port, ssl=self.target.tls, limit=_READ_LIMIT
        )
        self.keep_alive = True

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> Response:
        """Send one request and read the head; the caller must consume the body."""
        if self.writer is None or not self.keep_alive:
            await self.close()
            await self.open()
        assert self.writer is not None
        head = [
            f"{method} {path} HTTP/1.1".encode(),
            b"Host: " + self._host_header,
            *_BASE_LINES,
            b"Content-Length: " + str(len(body)).encode(),
        ]
        head += [f"{k}: {v}".encode() for k, v in (headers or {}).items()]
        try:
            self.writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
            return await self._read_head()
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            self.keep_alive = False
            raise HttpError(f"request failed: {exc!r}") from exc

    async def _read_head(self) -> Response:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw[:-4].split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise HttpError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        response = Response(status=int(parts[1]), headers=headers, connection=self)
        if headers.get("connection", "").lower() == "close":
            self.keep_alive = False
        if "chunked" in headers.get("transfer-encoding", "").lower():
            response._chunked = True
        elif "content-length" in headers:
            response._remaining = int(headers["content-length"])
        return response

    async def close(self) -> None:
        writer, self.writer = self.writer, None
        self.keep_alive = False
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except (OSError, ssl.SSLError):
                pass
