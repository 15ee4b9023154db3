"""Who may call a route or a gRPC method: the access classes, shared by the route declarations
(server/http/routes.py), the keys (server/http/auth.py) and the gRPC interceptor
(server/http/rpc.py)."""

from __future__ import annotations

import enum


class Access(enum.Enum):
    """Who may call a route (server/http/auth.py has the keys).

    OPEN: the health and readiness family; probes need no credentials. DATA: inference and
    information (API or admin key). METRICS: scrapes (same keys as DATA). ADMIN: control plane
    and adapter management (admin key; with no admin keys configured, an API key)."""

    OPEN = "open"
    DATA = "data"
    METRICS = "metrics"
    ADMIN = "admin"
