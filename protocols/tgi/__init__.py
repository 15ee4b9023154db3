"""Hugging Face Text Generation Inference's API."""

from protocols.tgi import errors, routes
from server.http.routes import ProtocolSpec

SPEC = ProtocolSpec(
    name=routes.NAME,
    render=errors.render,
    routes=routes.routes,
    options=routes.TgiOptions,
    paths=frozenset({"/", "/generate", "/generate_stream", "/health", "/info", "/tokenize"}),
)
