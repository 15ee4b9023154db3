"""DJL Serving / SageMaker LMI: inference, the adapter management API and workflows."""

from protocols.djl import errors, options, routes
from server.http.routes import ProtocolSpec

SPEC = ProtocolSpec(
    name=routes.NAME,
    render=errors.render,
    routes=routes.routes,
    options=options.DjlOptions,
    paths=frozenset({
        "/ping", "/invocations", "/predictions/{model:path}", "/adapters", "/adapters/{name:path}",
        "/models/{model}/adapters", "/models/{model}/adapters/{rest:path}",
    }),
    startup=options.register_workflows,
)
