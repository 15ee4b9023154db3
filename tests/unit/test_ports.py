"""Binding the listeners' ports before the engine: a held port is refused with one line naming
the setting, also when held through SO_REUSEPORT (another gateway's workers); a worker joins its
supervisor's reservation, HTTP and gRPC alike. Real sockets on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from server.runtime.grpc_listener import GrpcPlan, bind_grpc
from server.runtime.ports import PortUnavailable, bind_port, check_free

pytestmark = pytest.mark.anyio
HOST = "127.0.0.1"


@pytest.fixture
def held() -> Iterator[int]:
    """A port listened on the way another gateway's worker does (SO_REUSEPORT, same user)."""
    sock = bind_port(HOST, 0, ("data",), listen=True, shared=True)
    yield sock.getsockname()[1]
    sock.close()


def plan(port: int, *, shared: bool) -> GrpcPlan:
    return GrpcPlan(host=HOST, port=port, credentials=None, peer_allowed=None,
                    max_message_bytes=1024, shared=shared)


def test_a_held_port_is_refused_naming_every_setting_of_the_address(held: int) -> None:
    with pytest.raises(PortUnavailable) as refused:
        check_free(HOST, held, ("management", "metrics"))
    assert str(refused.value) == (
        f"ServerConfig.managementPort and ServerConfig.metricsPort: {HOST}:{held} is already in "
        "use by another process; not starting (free the port or set another)"
    )
    with pytest.raises(PortUnavailable):
        bind_port(HOST, held, ("data",), listen=True)


def test_an_address_that_cannot_be_bound_says_why() -> None:
    with pytest.raises(PortUnavailable) as refused:
        bind_port("192.0.2.1", 0, ("metrics",), listen=True)  # TEST-NET-1: not this host's
    assert str(refused.value).startswith(
        "ServerConfig.metricsPort: 192.0.2.1:0 cannot be bound (Cannot assign requested address)"
    )


async def test_workers_join_their_supervisors_reservation_http_and_grpc() -> None:
    http = bind_port(HOST, 0, ("data",), listen=False, shared=True)
    grpc = bind_port(HOST, 0, ("grpc",), listen=False, shared=True)
    try:
        bind_port(HOST, http.getsockname()[1], ("data",), listen=True, shared=True).close()
    finally:
        http.close()
    bound = None
    try:
        bound = bind_grpc(plan(grpc.getsockname()[1], shared=True))
        assert bound is not None and bound.plan.port == grpc.getsockname()[1]
    finally:
        grpc.close()
        if bound is not None:
            await bound.server.stop(None)


async def test_a_single_servers_grpc_port_is_refused_when_held(held: int) -> None:
    with pytest.raises(PortUnavailable) as refused:
        bind_grpc(plan(held, shared=False))
    assert str(refused.value).startswith(f"ServerConfig.grpcPort: {HOST}:{held} is already")
    bound = bind_grpc(plan(0, shared=False))
    assert bound is not None and bound.plan.port > 0  # port 0 resolved
    await bound.server.stop(None)
