"""TLS and mutual TLS for each listener, from its `Tls` settings (server/settings/model.py).

In config.json these are MindIE's `ServerConfig` fields: `httpsEnabled`, `tlsCaPath` + `tlsCaFile`
(CAs trusted for client certificates), `tlsCert`, `tlsPk`, `tlsPkPwd` (a file holding the
password of an encrypted key), `tlsCrlPath` + `tlsCrlFiles`, and their `management*`/`metrics*`
variants. The loader has already filled each management/metrics field from the data listener's
when absent, so every listener's `Tls` here is complete.

Policy: TLS 1.2 minimum, ECDHE/DHE AEAD suites only for TLS 1.2 (TLS 1.3 suites are all AEAD),
no compression, no renegotiation, a client certificate chaining to the configured CA is
required, and each CRL is checked for the leaf. Every file problem (missing, unreadable, not a
certificate/key/CRL, key not matching the certificate, encrypted key without password) fails at
start-up with the field's name and a fix.
"""

from __future__ import annotations

import functools
import ipaddress
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from server.settings import (
    LISTENER_ROLES,
    ServerSettings,
    Settings,
    SettingsError,
    Tls,
    resolve_path,
)

# TLS 1.2 suites: forward secrecy and AEAD only. TLS 1.3 suites are OpenSSL's (all AEAD).
CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:!aNULL:!MD5:!DSS:!SHA1"
LISTENERS = LISTENER_ROLES


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsFiles:
    listener: str
    ca_files: tuple[str, ...]
    cert: str
    key: str
    key_password_file: str | None
    crl_files: tuple[str, ...]


def tls_files(settings: Settings, listener: str) -> TlsFiles | None:
    """The TLS files of `listener` ("data", "management", "metrics"), read from
    `settings.server.<listener>.tls`; None when plain HTTP. ValueError for another name."""
    return listener_tls_files(listener, settings.server.listener(listener).tls, settings)


def listener_tls_files(listener: str, tls: Tls, settings: Settings) -> TlsFiles | None:
    """`tls` with every file as a path (relative ones against `settings.base_dir`; CA and CRL
    names under `ca_path`/`crl_path`); None when `tls` is disabled. `listener` names errors."""
    if not tls.enabled:
        return None
    return TlsFiles(
        listener=listener,
        ca_files=tuple(resolve_path(settings, str(Path(tls.ca_path) / f)) for f in tls.ca_files),
        cert=resolve_path(settings, tls.cert),
        key=resolve_path(settings, tls.key),
        key_password_file=(
            resolve_path(settings, tls.key_password_file) if tls.key_password_file else None
        ),
        crl_files=tuple(
            resolve_path(settings, str(Path(tls.crl_path) / f)) for f in tls.crl_files
        ),
    )


def build_context(files: TlsFiles) -> ssl.SSLContext:
    """A server context that requires a client certificate chaining to the configured CA."""
    _require_files(files)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(CIPHERS)
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    _load_key_pair(context, files)
    context.verify_mode = ssl.CERT_REQUIRED
    for ca in files.ca_files:
        _load_into_store(context, files.listener, "tlsCaFile", ca, kind="x509")
    for crl in files.crl_files:
        _load_into_store(context, files.listener, "tlsCrlFiles", crl, kind="crl")
    if files.crl_files:
        context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return context


def _load_key_pair(context: ssl.SSLContext, files: TlsFiles) -> None:
    password = _password(files)
    try:
        context.load_cert_chain(files.cert, files.key, password=password)
    except _EncryptedKey:
        raise SettingsError(
            f"{files.listener} listener: ServerConfig.tlsPk: {files.key} is encrypted and no "
            "tlsPkPwd is set. Fix: set tlsPkPwd to a file holding the key's password"
        ) from None
    except (ssl.SSLError, ValueError, OSError) as exc:
        raise SettingsError(
            f"{files.listener} listener: ServerConfig.tlsCert/tlsPk do not load ({_reason(exc)})."
            " Fix: use a PEM certificate with its matching key (and tlsPkPwd for an encrypted key)"
        ) from None


class _EncryptedKey(Exception):
    """Raised by the password callback when the key is encrypted but no password is set."""


def _password(files: TlsFiles) -> Callable[[], bytes] | bytes:
    """The key password; without tlsPkPwd a callback that refuses, so OpenSSL never prompts."""
    if files.key_password_file is None:

        def refuse() -> bytes:
            raise _EncryptedKey

        return refuse
    password = Path(files.key_password_file).read_bytes().strip()
    if not password:
        raise SettingsError(
            f"{files.listener} listener: ServerConfig.tlsPkPwd: {files.key_password_file} is "
            "empty. Fix: write the key's password into it, or unset tlsPkPwd for a plain key"
        )
    return password


def _load_into_store(
    context: ssl.SSLContext, listener: str, field_name: str, path: str, *, kind: str
) -> None:
    """Load a CA bundle (kind "x509") or a CRL (kind "crl"); it must add at least one."""
    before = context.cert_store_stats()[kind]
    try:
        context.load_verify_locations(cafile=path)
    except (ssl.SSLError, OSError) as exc:
        raise SettingsError(
            f"{listener} listener: ServerConfig.{field_name}: {path} does not load "
            f"({_reason(exc)}). Fix: give a PEM file"
        ) from None
    if context.cert_store_stats()[kind] <= before:
        what = "CA certificate" if kind == "x509" else "certificate revocation list"
        raise SettingsError(
            f"{listener} listener: ServerConfig.{field_name}: {path} holds no new {what}. "
            f"Fix: point the field at a PEM {what}"
        )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or "not PEM, or a wrong key password")
    return str(exc)[:200] or exc.__class__.__name__


def _require_files(files: TlsFiles) -> None:
    named = [("tlsCaFile", f) for f in files.ca_files] + [
        ("tlsCert", files.cert),
        ("tlsPk", files.key),
    ]
    named += [("tlsCrlFiles", f) for f in files.crl_files]
    if files.key_password_file:
        named.append(("tlsPkPwd", files.key_password_file))
    for field_name, path in named:
        if not _readable(path):
            raise SettingsError(
                f"{files.listener} listener: ServerConfig.{field_name}: {path} is missing or "
                "unreadable. Fix: run `make certs` or point the field at your file"
            )


def _readable(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError:
        return False
    return True


def is_all_zero(host: str) -> bool:
    """0.0.0.0, ::, an empty host (asyncio binds every interface) and their spellings."""
    if not host.strip():
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def check_bind_address(server: ServerSettings, host: str, tls: bool) -> None:
    """MindIE refuses a plain-HTTP all-zero bind unless explicitly allowed."""
    if is_all_zero(host) and not tls and not server.allow_all_zero_ip:
        raise SettingsError(
            f"ServerConfig: refusing to listen on {host!r} (every interface) without HTTPS. "
            "Fix: set httpsEnabled true, bind a specific address, or set "
            "allowAllZeroIpListening true"
        )


# ---- gRPC ------------------------------------------------------------------------------------
def grpc_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Mutual TLS for the gRPC listener from the same files: checked as the HTTP listeners'
    (`build_context` raises the same start-up errors), then handed to gRPC in memory (an
    encrypted key is decrypted with its tlsPkPwd; gRPC takes only plain PEM)."""
    build_context(files)
    roots = b"".join(Path(ca).read_bytes() for ca in files.ca_files)
    pair = (plain_key(files), Path(files.cert).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=roots, require_client_auth=True)


def plain_key(files: TlsFiles) -> bytes:
    """The private key as plain PEM (decrypted with its tlsPkPwd when encrypted)."""
    pem = Path(files.key).read_bytes()
    password = _password(files)  # build_context has already checked it opens the key
    if not isinstance(password, bytes):
        return pem
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pem, password=password)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def revocation_check(files: TlsFiles) -> Callable[[bytes], bool] | None:
    """For the gRPC listener, whose TLS library takes no CRL: a check of a peer certificate
    (PEM) against the configured CRLs, True when it is not revoked; None without CRLs."""
    if not files.crl_files:
        return None
    from cryptography import x509

    crls = [x509.load_pem_x509_crl(Path(f).read_bytes()) for f in files.crl_files]

    @functools.lru_cache(maxsize=256)
    def not_revoked(pem: bytes) -> bool:
        try:
            serial = x509.load_pem_x509_certificate(pem).serial_number
        except ValueError:  # no certificate: mutual TLS let nothing unverifiable through
            return False
        return all(crl.get_revoked_certificate_by_serial_number(serial) is None for crl in crls)

    return not_revoked
