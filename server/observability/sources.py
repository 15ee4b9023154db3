"""Metrics of the remote adapter sources: fetches by outcome, download time and bytes.

Kept in the shared (multiprocess) files with several workers: only the registry's owner fetches,
and any worker may answer the scrape.
"""

from __future__ import annotations

from server.observability.families import Counter, Histogram
from server.sources.remote import FETCH_BUCKETS


class SourceMetrics:
    """The sources' `FetchObserver`."""

    def __init__(self, *, shared: bool) -> None:
        self.fetches = Counter(
            "gateway_adapter_source_fetches",
            "Adapter source fetches by scheme and outcome: downloaded, cached, missing (nothing "
            "there), invalid (not a usable adapter) or failed (unreachable, refused, too slow).",
            ("scheme", "outcome"), shared=shared,
        )
        self.seconds = Histogram(
            "gateway_adapter_source_fetch_seconds",
            "Time to download, check and cache an adapter from its source (retries included).",
            ("scheme",), FETCH_BUCKETS, shared=shared,
        )
        self.bytes = Counter(
            "gateway_adapter_source_bytes", "Bytes downloaded from adapter sources.",
            ("scheme",), shared=shared,
        )
        self.families = (self.fetches, self.seconds, self.bytes)

    def fetched(self, scheme: str, seconds: float, size: int) -> None:
        self.fetches.labels(scheme, "downloaded").inc()
        self.seconds.labels(scheme).observe(seconds)
        self.bytes.labels(scheme).inc(size)

    def cached(self, scheme: str) -> None:
        self.fetches.labels(scheme, "cached").inc()

    def failed(self, scheme: str, outcome: str) -> None:
        self.fetches.labels(scheme, outcome).inc()
