"""Wire protocols. Each package translates one protocol to and from `server.core` types."""
