"""OpenAI's API as vLLM serves it (with vLLM's extensions)."""

from protocols.openai_v1 import errors, routes
from server.http.routes import ProtocolSpec

SPEC = ProtocolSpec(name=routes.NAME, render=errors.render, routes=routes.routes)
