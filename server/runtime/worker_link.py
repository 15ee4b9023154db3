"""The link between worker processes (`ServerConfig.workers` > 1): one adapter registry, and
operations one worker asks of the others (`server.core.peers`).

Worker 0 owns the registry: the only one that validates adapters, adds them to and removes them
from the engine core, counts their requests and decides evictions, so an adapter loads once and
the engine never holds one the registry does not know. The other workers mirror it
(`MirrorRegistry`): they list, describe and route from a copy of its names, aliases and refusals
that the owner pushes after every change and before that change is answered (`RegistryOwner.
publish` waits for each mirror's acknowledgement), and they send every command of the registry's
command set (`server.core.adapter_commands`: management calls, an adapter request's acquire) and
every release to the owner over a Unix socket in the supervisor's private directory: a mirror is
an `AdapterRegistry` whose owner port is its `OwnerLink`. Generation itself never goes through
this link: each worker is its own client of the engine core (vLLM's multi-API-server launch).

Peer operations (a stopInfer or a stored response that belongs to another worker) travel the same
star: a mirror's `ask` runs in the owner and is relayed by it to every other mirror.

Messages are pickled: both ends are this program, and the socket's directory is the supervisor's
own (mode 0700).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from server.core.adapter_commands import Acquire, Command
from server.core.adapter_files import AdapterRules
from server.core.adapter_sources import AdapterFetcher
from server.core.adapters import AdapterLimits, AdapterRegistry, RegistryView
from server.core.composition import Composition
from server.core.engine import Engine
from server.core.errors import EngineError, GatewayError, ServiceUnavailable
from server.core.peers import Peers
from server.core.types import AdapterHandle

logger = logging.getLogger("gateway.adapters")

_FRAME = struct.Struct("!I")
T = TypeVar("T")
ACK_TIMEOUT_S = 30.0  # a mirror that does not take a change this long is stuck: say so
CONNECT_TIMEOUT_S = 600.0  # the owner starts its engine client first (tens of seconds)


@dataclass(frozen=True, slots=True)
class PeerAsk:
    """A mirror's peer operation: run in the owner, then relayed to every other mirror."""

    op: str
    args: tuple[Any, ...]


Call = Command[Any] | PeerAsk  # what a mirror asks of the owner: ("call", call_id, Call)


def _frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _FRAME.pack(len(data)) + data


async def _receive(reader: asyncio.StreamReader) -> Any:
    (size,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    return pickle.loads(await reader.readexactly(size))


class _Mirror:
    """The owner's side of one mirror's connection."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.acked = 0
        self._acks: dict[int, asyncio.Future[None]] = {}
        self._asks: dict[int, asyncio.Future[Any]] = {}
        self._ask_ids = itertools.count(1)

    async def ask(self, op: str, args: tuple[Any, ...]) -> list[Any]:
        """The mirror's answer to a peer operation ([] if it is gone or too slow)."""
        ask_id = next(self._ask_ids)
        answer = asyncio.get_running_loop().create_future()
        self._asks[ask_id] = answer
        try:
            self.send(("ask", ask_id, op, args))
            result: list[Any] = await asyncio.wait_for(answer, ACK_TIMEOUT_S)
        except (TimeoutError, ConnectionError):
            return []
        finally:
            self._asks.pop(ask_id, None)
        return result

    def answered(self, ask_id: int, value: list[Any]) -> None:
        answer = self._asks.get(ask_id)
        if answer is not None and not answer.done():
            answer.set_result(value)

    def send(self, message: object) -> None:
        self.writer.write(_frame(message))

    async def push(self, version: int, view: RegistryView) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._acks[version] = waiter
        self.send(("state", version, view))
        try:
            await asyncio.wait_for(waiter, ACK_TIMEOUT_S)
        except TimeoutError:
            logger.error("a worker did not take adapter change %d within %ss", version,
                         ACK_TIMEOUT_S)
        finally:
            self._acks.pop(version, None)

    def ack(self, version: int) -> None:
        self.acked = max(self.acked, version)
        for seen, waiter in list(self._acks.items()):
            if seen <= version and not waiter.done():
                waiter.set_result(None)

    def close(self) -> None:
        for waiter in self._acks.values():
            if not waiter.done():
                waiter.set_result(None)
        for answer in self._asks.values():
            if not answer.done():
                answer.set_result([])


class RegistryOwner:
    """Serves the registry of worker 0 to the mirrors, and relays peer operations. Made before
    the registry and the peers it serves, which take `publish` and `ask_mirrors` when built;
    `start` serves them."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._registry: AdapterRegistry | None = None  # served once started
        self._peers = Peers()
        self._mirrors: set[_Mirror] = set()
        self._leases: dict[int, AdapterHandle] = {}  # acquired by a mirror, not released yet
        self._lease_ids = itertools.count(1)
        self._version = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self, registry: AdapterRegistry, peers: Peers) -> None:
        """Serve `registry` (built with `on_change=self.publish`) and answer the mirrors' peer
        operations with `peers` (built with `remote=self.ask_mirrors`)."""
        self._registry, self._peers = registry, peers
        self._server = await asyncio.start_unix_server(self._serve, path=str(self._path))

    async def wait_mirrors_gone(self, timeout_s: float) -> None:
        """Until every mirror has disconnected (they do after their drain), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._mirrors and time.monotonic() < deadline:  # noqa: ASYNC110 (a set, no event)
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for mirror in list(self._mirrors):
            mirror.close()
            mirror.writer.close()

    async def publish(self) -> None:
        """Push the current view to every mirror; return once each has taken it."""
        if self._registry is None:
            return  # not serving yet: no mirror to tell
        self._version += 1
        version, view = self._version, self._registry.view()
        await asyncio.gather(*(mirror.push(version, view) for mirror in list(self._mirrors)))

    def _serving(self) -> AdapterRegistry:
        assert self._registry is not None, "mirrors connect only once the owner started"
        return self._registry

    async def ask_mirrors(
        self, op: str, args: tuple[Any, ...], origin: _Mirror | None = None
    ) -> list[Any]:
        mirrors = [m for m in list(self._mirrors) if m is not origin]
        answers = await asyncio.gather(*(m.ask(op, args) for m in mirrors))
        return [value for answer in answers for value in answer]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mirror = _Mirror(writer)
        self._mirrors.add(mirror)
        mirror.send(("state", self._version, self._serving().view()))
        try:
            while True:
                self._dispatch(mirror, await _receive(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._mirrors.discard(mirror)
            mirror.close()
            writer.close()

    def _dispatch(self, mirror: _Mirror, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ack":
            mirror.ack(message[1])
        elif kind == "answer":
            mirror.answered(message[1], message[2])
        elif kind == "release":
            handle = self._leases.pop(message[1], None)
            if handle is not None:
                self._serving().release(handle, message[2])
        elif kind == "call":
            task = asyncio.create_task(self._answer(mirror, message[1], message[2]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, mirror: _Mirror, call_id: int, call: Call) -> None:
        name = type(call).__name__
        try:
            value = await self._run(mirror, call)
            reply: tuple[Any, ...] = ("reply", call_id, True, value)
        except GatewayError as exc:
            reply = ("reply", call_id, False, exc)
        except Exception:
            logger.exception("adapter call %s from a worker failed", name)
            reply = ("reply", call_id, False, EngineError(f"the adapter call {name} failed"))
        with contextlib.suppress(ConnectionError):
            mirror.send(reply)

    async def _run(self, mirror: _Mirror, call: Call) -> Any:
        if isinstance(call, PeerAsk):  # a mirror's peer operation: here, then every other mirror
            here = await self._peers.run_here(call.op, call.args)
            return [here, *await self.ask_mirrors(call.op, call.args, origin=mirror)]
        if isinstance(call, Acquire):  # held by the mirror under a lease until it releases it
            handle = await self._serving().run(call)
            lease = next(self._lease_ids)
            self._leases[lease] = handle
            return lease, handle
        if isinstance(call, Command):
            return await self._serving().run(call)
        raise EngineError(f"unknown adapter call {call!r}")


class OwnerLink:
    """A mirror's connection to the owner (its registry's owner port): commands, releases, and
    the owner's pushed views. Made before the registry and the peers it serves, which take it and
    `ask_owner` when built; `connect` serves them."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._show: Callable[[RegistryView], None] | None = None
        self._peers = Peers()
        self._tasks: set[asyncio.Task[None]] = set()
        self._calls: dict[int, asyncio.Future[tuple[bool, Any]]] = {}
        self._abandoned: set[int] = set()  # acquires whose caller gave up: release on reply
        self._leases: dict[int, int] = {}  # id(handle) -> the owner's lease
        self._ids = itertools.count(1)
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._first_view = asyncio.Event()
        self._version = -1

    async def connect(
        self, show: Callable[[RegistryView], None], peers: Peers,
        timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        """Connect (the owner may still be starting), `show` the owner's views (the first before
        this returns) and answer the others' peer operations with `peers`."""
        self._show, self._peers = show, peers
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(str(self._path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise ServiceUnavailable("the adapter registry's owner did not start") from None
                await asyncio.sleep(0.1)
        self._reader_task = asyncio.create_task(self._read(reader))
        try:
            await asyncio.wait_for(self._first_view.wait(), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            raise ServiceUnavailable("the adapter registry's owner sent no view") from None
        if self._version < 0:  # set by `_lose`: the owner left before its first view
            raise ServiceUnavailable("the adapter registry's owner went away while starting")

    async def ask_owner(self, op: str, args: tuple[Any, ...]) -> list[Any]:
        """Every other worker's answer to a peer operation (the owner relays it)."""
        answers: list[Any] = await self.call(PeerAsk(op, args))
        return answers

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._writer is not None:
            self._writer.close()

    async def run(self, command: Command[T]) -> T:
        """The owner's answer to a command of this worker's registry."""
        if isinstance(command, Acquire):
            lease, handle = await self.call(command)
            self._leases[id(handle)] = lease
            return handle  # type: ignore[no-any-return]
        value: T = await self.call(command)
        return value

    def release(self, handle: AdapterHandle, generated_tokens: int) -> None:
        """Give back an adapter `run(Acquire)` answered (a no-op once the owner is gone)."""
        lease = self._leases.pop(id(handle), None)
        if lease is not None:
            with contextlib.suppress(ServiceUnavailable):
                self._release(lease, generated_tokens)

    async def call(self, call: Call) -> Any:
        call_id = next(self._ids)
        self._send(("call", call_id, call))
        reply = asyncio.get_running_loop().create_future()
        self._calls[call_id] = reply  # before any await: the reply cannot have come yet
        try:
            ok, value = await reply
        except asyncio.CancelledError:
            self._calls.pop(call_id, None)
            if isinstance(call, Acquire):
                self._abandoned.add(call_id)
            raise
        if not ok:
            raise value
        return value

    def _release(self, lease: int, generated_tokens: int) -> None:
        self._send(("release", lease, generated_tokens))

    def _send(self, message: object) -> None:
        if self._writer is None or self._writer.is_closing():
            raise _unreachable()
        self._writer.write(_frame(message))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                self._take(await _receive(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            logger.error("the adapter registry's owner went away")
        finally:
            self._lose()

    def _lose(self) -> None:
        """No reply comes any more: fail the calls waiting for one, and every later call
        (`_send`: closed here, as uvloop keeps a socket whose peer left open until a write
        fails), rather than let them wait for ever."""
        if self._writer is not None:
            self._writer.close()
        self._first_view.set()  # `connect` waits for it no longer
        for reply in self._calls.values():
            if not reply.done():
                reply.set_result((False, _unreachable()))
        self._calls.clear()

    def _take(self, message: tuple[Any, ...]) -> None:
        if message[0] == "ask":
            task = asyncio.create_task(self._answer(*message[1:]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        if message[0] == "state":
            _, version, view = message
            if version > self._version and self._show is not None:
                self._version = version
                self._show(view)
            self._first_view.set()
            self._send(("ack", version))
            return
        _, call_id, ok, value = message
        reply = self._calls.pop(call_id, None)
        if reply is not None and not reply.done():
            reply.set_result((ok, value))
        elif call_id in self._abandoned:
            self._abandoned.discard(call_id)
            if ok:
                self._release(value[0], 0)


    async def _answer(self, ask_id: int, op: str, args: tuple[Any, ...]) -> None:
        value = await self._peers.run_here(op, args)
        with contextlib.suppress(ServiceUnavailable, ConnectionError):
            self._send(("answer", ask_id, [value]))


def _unreachable() -> ServiceUnavailable:
    return ServiceUnavailable("the adapter registry is not reachable")


class MirrorRegistry(AdapterRegistry):
    """The registry of workers 1..N-1: an `AdapterRegistry` whose owner port is an `OwnerLink`.
    It reads from the owner's pushed view; every command runs in the owner. Only construction
    is its own: it overrides no method (tests/unit/test_adapter_commands.py)."""

    def __init__(  # noqa: PLR0913 - the owner's parts, as build_gateway passes them
        self, *, engine: Engine, rules: AdapterRules, limits: AdapterLimits,
        state_file: Path | None = None, fetcher: AdapterFetcher | None = None,
        composition: Composition | None = None,
        on_change: Callable[[], Awaitable[None]] | None = None, link: OwnerLink,
    ) -> None:
        del state_file, composition, on_change  # the owner keeps, composes and publishes
        # the fetcher tells which names sources may hold; the owner does every fetch
        super().__init__(engine=engine, rules=rules, limits=limits, fetcher=fetcher, owner=link)
        self.link = link


__all__ = ["MirrorRegistry", "OwnerLink", "RegistryOwner"]
