"""Bearer credentials (or `x-api-key`): the configured API and admin keys, and which access class
each opens.

Keys are compared as SHA-256 digests with `hmac.compare_digest` against every configured key,
so neither the key nor its length leaks through timing (CVE-2025-59425). The decision uses the
route the listener app resolved from the ASGI `scope["path"]`, the very path it dispatches on,
never the Host-derived URL (CVE-2026-48710, CVE-2026-48746).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from server.http.access import Access


class Keyring:
    def __init__(self, api_keys: Iterable[str] = (), admin_keys: Iterable[str] = ()) -> None:
        self.api = tuple(_digest(k.encode()) for k in api_keys if k)
        self.admin = tuple(_digest(k.encode()) for k in admin_keys if k)

    @property
    def configured(self) -> bool:
        return bool(self.api or self.admin)

    def accepted(self, access: Access) -> tuple[bytes, ...] | None:
        """The digests that open `access`; None when it is open."""
        if access is Access.OPEN:
            return None
        if access is Access.ADMIN:
            return self.admin or self.api or None
        return (self.api + self.admin) if self.api else None

    def allows(self, access: Access, token: bytes | None) -> bool:
        keys = self.accepted(access)
        if keys is None:
            return True
        presented = _digest(token or b"")
        found = False
        for key in keys:  # no early exit: the time does not depend on which key matched
            found |= hmac.compare_digest(presented, key)
        return found and token is not None


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def presented_key(authorization: bytes | None, api_key: bytes | None) -> bytes | None:
    """The key a request presents: its `Authorization: Bearer` token, else its `x-api-key`
    header (what Anthropic's SDKs before 1.0 and many agents send)."""
    token = bearer_token(authorization)
    if token is None and api_key is not None:
        token = api_key.strip() or None
    return token


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header value, if any."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip() or None
