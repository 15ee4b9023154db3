"""Metrics (Prometheus, MindIE JSON) and logs: how the gateway reports what it does."""
