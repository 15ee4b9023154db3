"""Helpers shared by every protocol: JSON codec, body parsing, streaming responses."""
