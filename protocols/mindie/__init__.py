"""Huawei MindIE's native inference API (the management routes are the control plane's)."""

from protocols.mindie import errors, routes
from server.http.routes import ProtocolSpec

SPEC = ProtocolSpec(name=routes.NAME, render=errors.render, routes=routes.routes)
