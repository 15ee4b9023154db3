"""`https://host/path/name.tar.gz` (or .tgz, .tar, .zip): an adapter archive over HTTPS,
optionally pinned by `#sha256=<hex>` of its bytes; TLS verified against the system's CA store
or `LoraConfig.adapterSourceCaFile`."""

from __future__ import annotations

import hashlib
import re
import ssl
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from server.core.adapter_sources import AdapterSourceFailed
from server.core.errors import AdapterInvalid, AdapterSourceMissing
from server.sources.archive import archive_kind, unpack
from server.sources.remote import Deadline, Transient

_PIN = re.compile(r"^sha256=([0-9a-fA-F]{64})$")
_ARCHIVE = "download.archive"


class HttpsRemote:
    scheme = "https"

    def __init__(self, max_bytes: int, ca_file: str | None = None) -> None:
        self._max_bytes = max_bytes
        self._tls = ssl.create_default_context(cafile=ca_file)

    def version(self, location: str, deadline: Deadline) -> str | None:
        _parse(location)
        return location  # an archive's URL (and its pin) names its contents

    def download(self, location: str, dest: Path, deadline: Deadline) -> int:
        url, kind, pin = _parse(location)
        archive = dest / _ARCHIVE
        size, digest = self._get(url, archive, deadline)
        if pin is not None and digest != pin:
            raise AdapterInvalid(
                f"The archive at {url} has sha256 {digest}, not the pinned {pin}", param="src"
            )
        unpacked = dest / "unpacked"
        unpacked.mkdir()
        root = unpack(archive, kind, unpacked, self._max_bytes)
        archive.unlink()
        for entry in root.iterdir():
            entry.rename(dest / entry.name)
        return size

    def _get(self, url: str, target: Path, deadline: Deadline) -> tuple[int, str]:
        digest = hashlib.sha256()
        written = 0
        timeout = httpx.Timeout(deadline.io_timeout())
        try:
            with httpx.Client(verify=self._tls, timeout=timeout, follow_redirects=True,
                              trust_env=False) as client, client.stream("GET", url) as answer:
                _check_status(answer.status_code, url)
                with target.open("wb") as handle:
                    for chunk in answer.iter_bytes(1 << 20):
                        deadline.check(url)
                        written += len(chunk)
                        if written > self._max_bytes:
                            raise AdapterInvalid(
                                f"The archive at {url} is larger than {self._max_bytes} bytes "
                                "(adapterCacheGiB)", param="src",
                            )
                        digest.update(chunk)
                        handle.write(chunk)
        except httpx.TransportError as exc:
            if _tls_refused(exc):
                raise AdapterSourceFailed(f"TLS verification of {url} failed: {exc}",
                                          param="src") from None
            raise Transient(f"{type(exc).__name__}: {exc}") from None
        return written, digest.hexdigest()


def _parse(location: str) -> tuple[str, str, str | None]:
    url, _, fragment = location.partition("#")
    pin = None
    if fragment:
        match = _PIN.match(fragment)
        if match is None:
            raise AdapterInvalid(f"Unknown fragment #{fragment[:80]}: use #sha256=<64 hex>",
                                 param="src")
        pin = match.group(1).lower()
    kind = archive_kind(urlsplit(url).path)
    if kind is None:
        raise AdapterInvalid(
            f"{url} is not an adapter archive: use .tar.gz, .tgz, .tar or .zip", param="src"
        )
    return url, kind, pin


def _check_status(status: int, url: str) -> None:
    if status < 400:
        return
    if status in (404, 410):
        raise AdapterSourceMissing(f"No adapter found at {url}", param="src")
    if status == 429 or status >= 500:
        raise Transient(f"HTTP {status}")
    raise AdapterSourceFailed(f"{url} answered HTTP {status}", param="src")


def _tls_refused(exc: httpx.TransportError) -> bool:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return True
        cause = cause.__cause__ or cause.__context__
    return "CERTIFICATE_VERIFY_FAILED" in str(exc)
