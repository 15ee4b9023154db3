"""The server's own management routes: the OpenAPI documents and gRPC health."""
