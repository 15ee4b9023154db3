"""OpenAI's API as vLLM serves it (with vLLM's extensions)."""

from protocols.openai_v1 import errors, routes
from server.http.routes import ProtocolSpec

SPEC = ProtocolSpec(
    name=routes.NAME,
    render=errors.render,
    routes=routes.routes,
    paths=frozenset({
        "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model:path}",
        "/v1/responses", "/v1/responses/{rest:path}", "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter", "/detokenize", "/version",
    }),
)
