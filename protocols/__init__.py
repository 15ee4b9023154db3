"""The protocols the gateway speaks, and the one registry of them.

Adding a protocol is one package exporting a `SPEC` (server/http/routes.py `ProtocolSpec`)
and one line here. The server knows protocols only through this tuple; the first one answers
for paths no route on the data listener matches.
"""

from protocols import anthropic, djl, kserve_v2, mindie, openai_v1, tgi
from server.http.routes import ProtocolSpec

REGISTRY: tuple[ProtocolSpec, ...] = (
    openai_v1.SPEC,
    tgi.SPEC,
    kserve_v2.SPEC,
    mindie.SPEC,
    djl.SPEC,
    anthropic.SPEC,
)
