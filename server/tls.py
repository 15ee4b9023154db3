"""TLS and mutual TLS for each listener, from MindIE-style `ServerConfig` fields.

Fields (MindIE names): `httpsEnabled`, `tlsCaPath` + `tlsCaFile` (CAs trusted for client
certificates), `tlsCert`, `tlsPk`, `tlsPkPwd` (a file holding the password of an encrypted key),
`tlsCrlPath` + `tlsCrlFiles`. The management and metrics listeners read `management*`/`metrics*`
variants (`managementHttpsEnabled`, `managementTlsCaFile`, ...), each falling back to the data
listener's field when absent.

Policy: TLS 1.2 minimum, ECDHE/DHE AEAD suites only for TLS 1.2 (TLS 1.3 suites are all AEAD),
no compression, no renegotiation, a client certificate chaining to the configured CA is
required, and each CRL is checked for the leaf. Every file problem (missing, unreadable, not a
certificate/key/CRL, key not matching the certificate, encrypted key without password) fails at
start-up with the field's name and a fix.
"""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from server.settings import ServerSection, Settings, SettingsError, resolve_path

# TLS 1.2 suites: forward secrecy and AEAD only. TLS 1.3 suites are OpenSSL's (all AEAD).
CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:!aNULL:!MD5:!DSS:!SHA1"
LISTENERS = ("data", "management", "metrics")


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsFiles:
    listener: str
    ca_files: tuple[str, ...]
    cert: str
    key: str
    key_password_file: str | None
    crl_files: tuple[str, ...]


def tls_files(settings: Settings, listener: str) -> TlsFiles | None:
    """The TLS files of `listener` ("data", "management", "metrics"); None when plain HTTP.

    `management*`/`metrics*` fields default to the data listener's when absent."""
    if listener not in LISTENERS:
        raise ValueError(f"unknown listener {listener!r}")
    server = settings.ServerConfig
    prefix = "" if listener == "data" else listener

    def pick(name: str) -> object:
        own = getattr(server, f"{prefix}{name}", None) if prefix else None
        return own if own is not None else getattr(server, _lower_first(name))

    if not pick("HttpsEnabled"):
        return None
    ca_dir = server.tlsCaPath
    crl_dir = pick("TlsCrlPath")
    ca_files = pick("TlsCaFile")
    crl_files = pick("TlsCrlFiles")
    assert isinstance(ca_files, list) and isinstance(crl_files, list) and isinstance(crl_dir, str)
    return TlsFiles(
        listener=listener,
        ca_files=tuple(resolve_path(settings, str(Path(ca_dir) / f)) for f in ca_files),
        cert=resolve_path(settings, str(pick("TlsCert"))),
        key=resolve_path(settings, str(pick("TlsPk"))),
        key_password_file=_optional_path(settings, pick("TlsPkPwd")),
        crl_files=tuple(resolve_path(settings, str(Path(crl_dir) / f)) for f in crl_files),
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


def _optional_path(settings: Settings, value: object) -> str | None:
    return resolve_path(settings, value) if isinstance(value, str) and value else None


def _lower_first(name: str) -> str:
    return name[0].lower() + name[1:]


def is_all_zero(host: str) -> bool:
    """0.0.0.0, ::, an empty host (asyncio binds every interface) and their spellings."""
    if not host.strip():
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def check_bind_address(server: ServerSection, host: str, tls: bool) -> None:
    """MindIE refuses a plain-HTTP all-zero bind unless explicitly allowed."""
    if is_all_zero(host) and not tls and not server.allowAllZeroIpListening:
        raise SettingsError(
            f"ServerConfig: refusing to listen on {host!r} (every interface) without HTTPS. "
            "Fix: set httpsEnabled true, bind a specific address, or set "
            "allowAllZeroIpListening true"
        )
