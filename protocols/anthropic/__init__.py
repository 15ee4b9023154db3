"""Anthropic's Messages API, as vLLM serves it (with forced tool calls held to their schema)."""

from protocols.anthropic import errors, routes
from server.http.routes import ProtocolSpec

SPEC = ProtocolSpec(
    name=routes.NAME,
    render=errors.render,
    routes=routes.routes,
    paths=frozenset({"/v1/messages", "/v1/messages/count_tokens"}),
)
