"""The process: listeners and their TLS and limits, engine start, drain and stop."""
