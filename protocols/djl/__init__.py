"""DJL Serving / SageMaker LMI: inference and the adapter management API."""

from protocols.djl import errors, routes
from server.http.routes import ProtocolSpec

SPEC = ProtocolSpec(name=routes.NAME, render=errors.render, routes=routes.routes)
