"""TLS and mutual TLS for each listener, from MindIE-style `ServerConfig` fields.

TLS 1.2 minimum, modern ciphers, client certificates required and verified against the CA,
CRLs checked when configured. Every file problem fails at start-up with the field's name.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from server.settings import ServerSection, Settings, SettingsError, resolve_path

CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:!aNULL:!MD5:!DSS:!SHA1"


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
    server = settings.ServerConfig
    prefix = "" if listener == "data" else listener

    def pick(name: str) -> object:
        own = getattr(server, f"{prefix}{name}", None) if prefix else None
        return own if own is not None else getattr(server, _lower_first(name))

    enabled = pick("HttpsEnabled")
    if not enabled:
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
    password = _read_password(files.key_password_file)
    try:
        context.load_cert_chain(files.cert, files.key, password=password)
    except (ssl.SSLError, ValueError) as exc:
        raise SettingsError(
            f"{files.listener} listener: tlsCert/tlsPk do not load ({exc}). "
            "Fix: use a matching certificate and key (and tlsPkPwd for an encrypted key)"
        ) from None
    context.verify_mode = ssl.CERT_REQUIRED
    for ca in files.ca_files:
        context.load_verify_locations(cafile=ca)
    for crl in files.crl_files:
        context.load_verify_locations(cafile=crl)
    if files.crl_files:
        context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return context


def _require_files(files: TlsFiles) -> None:
    named = [("tlsCaFile", f) for f in files.ca_files] + [
        ("tlsCert", files.cert),
        ("tlsPk", files.key),
    ]
    named += [("tlsCrlFiles", f) for f in files.crl_files]
    if files.key_password_file:
        named.append(("tlsPkPwd", files.key_password_file))
    for field_name, path in named:
        if not Path(path).is_file():
            raise SettingsError(
                f"{files.listener} listener: ServerConfig.{field_name}: {path} is missing or "
                "unreadable. Fix: run `make certs` or point the field at your file"
            )


def _read_password(path: str | None) -> bytes | None:
    return Path(path).read_bytes().strip() if path else None


def _optional_path(settings: Settings, value: object) -> str | None:
    return resolve_path(settings, value) if isinstance(value, str) and value else None


def _lower_first(name: str) -> str:
    return name[0].lower() + name[1:]


def check_bind_address(server: ServerSection, host: str, tls: bool) -> None:
    """MindIE refuses a plain-HTTP all-zero bind unless explicitly allowed."""
    if host in ("0.0.0.0", "::") and not tls and not server.allowAllZeroIpListening:
        raise SettingsError(
            f"ServerConfig: refusing to listen on {host} without HTTPS. Fix: set httpsEnabled "
            "true, bind a specific address, or set allowAllZeroIpListening true"
        )
