"""Labelled Prometheus counters, gauges and histograms kept as plain numbers, for the per-request
and per-token paths.

prometheus_client's metric classes take a lock per update (a histogram one per bucket and one
for the sum) and check their state on every call: about 1 µs per counter increment and 2 µs per
histogram observation, which the gateway paid several times per request and once per streamed
token. These are updated from the event loop only (no lock needed), look their label set up once
(`labels()` returns the series, kept by the caller), and expose the same families as
prometheus_client would (`_total` for counters; `_bucket`, `_count`, `_sum` for histograms).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class Value:
    """One label set of a counter or gauge."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


class Observations:
    """One label set of a histogram: `counts[i]` values fell in bucket i (the last is +Inf)."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value

    def observe_each(self, values: Iterable[float]) -> None:
        counts, bounds = self.counts, self._bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1
            self.sum += value


S = TypeVar("S", Value, Observations)


class _Family(Collector, Generic[S]):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.series: dict[tuple[str, ...], S] = {}

    def labels(self, *values: str) -> S:
        series = self.series.get(values)
        if series is None:
            series = self.series[values] = self._new()
        return series

    def _new(self) -> S:
        raise NotImplementedError


class Counter(_Family[Value]):
    def _new(self) -> Value:
        return Value()

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in self.series.items():
            family.add_metric(list(values), series.value)
        yield family


class Gauge(_Family[Value]):
    def _new(self) -> Value:
        return Value()

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in self.series.items():
            family.add_metric(list(values), series.value)
        yield family


class Histogram(_Family[Observations]):
    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        super().__init__(name, documentation, labelnames)
        self._bounds = tuple(sorted(buckets))

    def _new(self) -> Observations:
        return Observations(self._bounds)

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        edges = [*(_le(b) for b in self._bounds), "+Inf"]
        for values, series in self.series.items():
            running, buckets = 0, []
            for edge, count in zip(edges, series.counts, strict=True):
                running += count
                buckets.append((edge, float(running)))
            family.add_metric(list(values), buckets, sum_value=series.sum)
        yield family


def _le(bound: float) -> str:
    """A bucket bound as prometheus_client writes it (`le="0.005"`, `le="10.0"`)."""
    text: str = floatToGoString(bound)  # type: ignore[no-untyped-call]
    return text
