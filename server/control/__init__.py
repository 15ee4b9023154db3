"""The control plane: MindIE's management routes, the health family and the OpenAPI documents."""
