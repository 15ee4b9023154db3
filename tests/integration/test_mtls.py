"""Mutual TLS on every listener, configured from MindIE `ServerConfig` fields (server/tls.py).

The matrix of RELIABILITY_PERF.md B.3 runs against four listeners: the data, management and
metrics listeners of a fake-engine server whose three planes all want client certificates (the
data plane with an encrypted key and `tlsPkPwd`), and the management listener of the shared
real-engine `live_server`. With TLS 1.3 a refused client certificate shows up after the
handshake, at the first read: any transport error (httpx ConnectError, ReadError,
RemoteProtocolError, WriteError) or curl exit 35/52/56 counts as refused.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serverproc import (
    CERTS,
    ROOT,
    RunningServer,
    base_config,
    merge,
    readme_curl,
    running_server,
)

CA = str(CERTS / "ca.pem")
REFUSED_BY_CURL = {35, 52, 56}  # handshake failure, empty reply, receive error (reset)


def client_context(
    cert: str | None = "client", *, tls_max: ssl.TLSVersion | None = None
) -> ssl.SSLContext:
    """A client that trusts the dev CA and presents `certs/<cert>.pem` with its key."""
    context = ssl.create_default_context(cafile=CA)
    if cert is not None:
        context.load_cert_chain(str(CERTS / f"{cert}.pem"), str(CERTS / f"{cert}.key"))
    if tls_max is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # old versions, on purpose
            context.minimum_version = ssl.TLSVersion.TLSv1
            context.maximum_version = tls_max
        context.set_ciphers("DEFAULT:@SECLEVEL=0")  # let the client offer what 1.1 needs
    return context


@dataclass(frozen=True)
class Target:
    """One TLS listener and a route on it that answers 200 to a trusted client."""

    name: str
    port: int
    path: str

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}{self.path}"


def all_tls_overrides() -> dict[str, Any]:
    return {
        "ServerConfig": {
            "httpsEnabled": True,
            "tlsPk": str(CERTS / "server-encrypted.key"),
            "tlsPkPwd": str(CERTS / "server-key-password.txt"),
            # the management and metrics planes name their own files (same dev CA, plain key)
            "managementTlsCert": str(CERTS / "server.pem"),
            "managementTlsPk": str(CERTS / "server.key"),
            "managementTlsPkPwd": "",
            "metricsTlsCaFile": ["ca.pem"],
            "metricsTlsCrlFiles": ["crl.pem"],
        }
    }


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("mtls")
    with running_server(
        folder, engine="fake", overrides=all_tls_overrides(), ready_timeout=60,
        client_tls=client_context(),
    ) as server:
        yield server


@pytest.fixture(scope="module")
def targets(tls_server: RunningServer, live_server: RunningServer) -> dict[str, Target]:
    return {
        "data": Target("data", tls_server.data_port, "/v1/models"),
        "management": Target("management", tls_server.management_port, "/v1/status"),
        "metrics": Target("metrics", tls_server.metrics_port, "/metrics"),
        "live-management": Target("live-management", live_server.management_port, "/v1/status"),
    }


LISTENER_NAMES = ["data", "management", "metrics", "live-management"]
REFUSED_CLIENTS = {
    "no-client-cert": lambda: client_context(None),
    "cert-from-another-ca": lambda: client_context("rogue-client"),
    "expired-cert": lambda: client_context("expired-client"),
    "revoked-cert": lambda: client_context("revoked-client"),
    "tls-1.1": lambda: client_context(tls_max=ssl.TLSVersion.TLSv1_1),
}


@pytest.mark.parametrize("listener", LISTENER_NAMES)
def test_trusted_client_certificate_is_served(
    targets: dict[str, Target], listener: str
) -> None:
    target = targets[listener]
    with httpx.Client(verify=client_context(), timeout=30) as http:
        response = http.get(target.url)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("case", sorted(REFUSED_CLIENTS))
@pytest.mark.parametrize("listener", LISTENER_NAMES)
def test_untrusted_client_is_refused(
    targets: dict[str, Target], listener: str, case: str
) -> None:
    target = targets[listener]
    with (
        httpx.Client(verify=REFUSED_CLIENTS[case](), timeout=30) as http,
        pytest.raises(httpx.TransportError),
    ):
        http.get(target.url)


@pytest.mark.parametrize("listener", LISTENER_NAMES)
def test_plain_http_to_the_tls_port_gets_no_answer(
    targets: dict[str, Target], listener: str
) -> None:
    target = targets[listener]
    with httpx.Client(timeout=30) as http, pytest.raises(httpx.TransportError):
        http.get(f"http://127.0.0.1:{target.port}{target.path}")


def test_tls_1_1_is_refused_by_the_server_not_by_the_client(targets: dict[str, Target]) -> None:
    """The same client context completes a TLS 1.1 handshake with a server that allows it, so
    the refusal of the gateway is the gateway's TLS 1.2 floor."""
    context = client_context(tls_max=ssl.TLSVersion.TLSv1_1)
    assert handshake_with_lenient_server(context) == "TLSv1.1"
    with httpx.Client(verify=context, timeout=30) as http, pytest.raises(httpx.ConnectError):
        http.get(targets["data"].url)


def handshake_with_lenient_server(client: ssl.SSLContext) -> str | None:
    """The TLS version `client` agrees with a loopback server that accepts TLS 1.0 and up."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        server.minimum_version = ssl.TLSVersion.TLSv1
    server.set_ciphers("DEFAULT:@SECLEVEL=0")
    server.load_cert_chain(str(CERTS / "server.pem"), str(CERTS / "server.key"))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def accept() -> None:
            conn, _ = listener.accept()
            with contextlib.suppress(OSError), server.wrap_socket(conn, server_side=True):
                pass

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, client.wrap_socket(
            raw, server_hostname="localhost"
        ) as tls:
            version = tls.version()
        thread.join(10)
    return version


def test_server_speaks_tls_1_3_and_offers_only_aead_suites_on_1_2(
    targets: dict[str, Target],
) -> None:
    for tls_max, expected in ((None, "TLSv1.3"), (ssl.TLSVersion.TLSv1_2, "TLSv1.2")):
        context = client_context()
        if tls_max is not None:
            context.maximum_version = tls_max
        with httpx.Client(verify=context, timeout=30) as http, http.stream(
            "GET", targets["data"].url
        ) as response:
            stream = response.extensions["network_stream"]
            ssl_object = stream.get_extra_info("ssl_object")
            assert ssl_object.version() == expected
            cipher = ssl_object.cipher()[0]
            assert "GCM" in cipher or "CHACHA20" in cipher


def test_certificate_without_its_key_cannot_be_offered() -> None:
    """B.7 #18 "wrong key": OpenSSL refuses to pair a certificate with another key, so a client
    cannot present client.pem without client.key (the handshake's CertificateVerify proves it)."""
    context = ssl.create_default_context(cafile=CA)
    with pytest.raises(ssl.SSLError, match="KEY_VALUES_MISMATCH"):
        context.load_cert_chain(str(CERTS / "client.pem"), str(CERTS / "rogue-client.key"))


# ---- curl, as the README shows it ------------------------------------------------------------
def curl(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["curl", "-s", "--max-time", "30", "--cacert", "certs/ca.pem", *args, url],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )


@pytest.mark.parametrize("listener", LISTENER_NAMES)
def test_curl_with_the_readme_flags_is_served(targets: dict[str, Target], listener: str) -> None:
    target = targets[listener]
    url = f"https://localhost:{target.port}{target.path}"
    done = curl(url, "--cert", "certs/client.pem", "--key", "certs/client.key")
    assert done.returncode == 0, done.stderr
    assert done.stdout


def test_the_readme_curl_example_works_verbatim(targets: dict[str, Target]) -> None:
    """The first curl block of README.md, pointed at this server's TLS data port."""
    done = subprocess.run(readme_curl(targets["data"].port), cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--cert", "certs/rogue-client.pem", "--key", "certs/rogue-client.key"],
        ["--cert", "certs/revoked-client.pem", "--key", "certs/revoked-client.key"],
        ["--cert", "certs/expired-client.pem", "--key", "certs/expired-client.key"],
        ["--cert", "certs/client.pem", "--key", "certs/client.key", "--tlsv1.0", "--tls-max",
         "1.1", "--ciphers", "DEFAULT:@SECLEVEL=0"],
    ],
    ids=["no-cert", "another-ca", "revoked", "expired", "tls-1.1"],
)
def test_curl_without_a_trusted_certificate_is_refused(
    targets: dict[str, Target], flags: list[str]
) -> None:
    done = curl(f"https://localhost:{targets['data'].port}/v1/models", *flags)
    assert done.returncode in REFUSED_BY_CURL, (done.returncode, done.stdout)


# ---- separate planes (B.7 #20) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def split_planes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Data plane trusts the dev CA; the management plane trusts only another CA."""
    overrides = {
        "ServerConfig": {
            "httpsEnabled": True,
            "managementTlsCaFile": ["rogue-ca.pem"],
            "managementTlsCrlFiles": [],
        }
    }
    folder = tmp_path_factory.mktemp("planes")
    with running_server(
        folder, engine="fake", overrides=overrides, ready_timeout=60,
        client_tls=client_context(),
    ) as server:
        yield server


def test_business_certificate_cannot_reach_separated_management_plane(
    split_planes: RunningServer,
) -> None:
    data = f"https://127.0.0.1:{split_planes.data_port}"
    management = f"https://127.0.0.1:{split_planes.management_port}"
    with httpx.Client(verify=client_context(), timeout=30) as business:
        assert business.get(f"{data}/v1/models").status_code == 200
        assert business.get(f"{data}/v1/status").status_code == 404  # not a data route
        with pytest.raises(httpx.TransportError):
            business.get(f"{management}/v1/status")
    operator = ssl.create_default_context(cafile=CA)
    operator.load_cert_chain(str(CERTS / "rogue-client.pem"), str(CERTS / "rogue-client.key"))
    with httpx.Client(verify=operator, timeout=30) as http:
        assert http.get(f"{management}/v1/status").status_code == 200
        with pytest.raises(httpx.TransportError):
            http.get(f"{data}/v1/models")


# ---- start-up refusals -----------------------------------------------------------------------
def start_fails(tmp_path: Path, server_config: dict[str, Any]) -> str:
    """Start `python -m server` with these ServerConfig fields; it must exit 2. Its stderr."""
    config = merge(base_config("fake"), {"ServerConfig": server_config})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-m", "server", "--config", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stderr


STARTUP_ERRORS = {
    "missing-ca": ({"httpsEnabled": True, "tlsCaFile": ["nope.pem"]}, "tlsCaFile"),
    "unreadable-cert": ({"httpsEnabled": True, "tlsCert": "/nonexistent/server.pem"}, "tlsCert"),
    "key-not-matching-cert": (
        {"httpsEnabled": True, "tlsPk": str(CERTS / "client.key")},
        "KEY_VALUES_MISMATCH",
    ),
    "encrypted-key-without-password": (
        {"httpsEnabled": True, "tlsPk": str(CERTS / "server-encrypted.key")},
        "tlsPkPwd",
    ),
    "wrong-key-password": (
        {
            "httpsEnabled": True,
            "tlsPk": str(CERTS / "server-encrypted.key"),
            "tlsPkPwd": str(CERTS / "ca.pem"),
        },
        "tlsPk",
    ),
    "crl-that-is-not-a-crl": ({"tlsCrlFiles": ["ca.pem"]}, "tlsCrlFiles"),  # management plane
    "plain-http-on-all-interfaces": (
        {"ipAddress": "0.0.0.0", "httpsEnabled": False},
        "allowAllZeroIpListening",
    ),
}


@pytest.mark.parametrize("case", sorted(STARTUP_ERRORS))
def test_bad_tls_configuration_fails_at_start_naming_the_field(
    tmp_path: Path, case: str
) -> None:
    fields, named = STARTUP_ERRORS[case]
    stderr = start_fails(tmp_path, fields)
    assert "configuration error" in stderr
    assert named in stderr
    assert "Traceback" not in stderr
