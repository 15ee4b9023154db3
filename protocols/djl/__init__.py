"""DJL Serving / SageMaker LMI: inference, the adapter management API and workflows."""

from protocols.djl import errors, options, routes
from server.http.routes import ProtocolSpec

SPEC = ProtocolSpec(
    name=routes.NAME,
    render=errors.render,
    routes=routes.routes,
    options=options.DjlOptions,
    startup=options.register_workflows,
)
