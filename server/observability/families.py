"""Labelled Prometheus counters, gauges and histograms kept as plain numbers, for the per-request
and per-token paths.

prometheus_client's metric classes take a lock per update (a histogram one per bucket and one
for the sum) and check their state on every call: about 1 µs per counter increment and 2 µs per
histogram observation, which the gateway paid several times per request and once per streamed
token. These are updated from the event loop only (no lock needed), look their label set up once
(`labels()` returns the series, kept by the caller), and expose the same families as
prometheus_client would (`_total` for counters; `_bucket`, `_count`, `_sum` for histograms).

With several worker processes (`PROMETHEUS_MULTIPROC_DIR` set, server/observability/shared.py) a
family made with `shared=True` keeps its series in prometheus_client's multiprocess file of this
process instead, under the keys prometheus_client's own classes would use, so that
`MultiProcessCollector` merges them with every other worker's: such a family is not collected
itself (`empty()` declares it).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Generic, Protocol, TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString
from prometheus_client.values import ValueClass


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
        """A request's token gaps: often the same value many times (a non-streamed answer's
        mean gap), looked up once per run of equal values; the sum adds them one by one."""
        counts, bounds, total = self.counts, self._bounds, self.sum
        last, index = None, 0
        for value in values:
            if value != last:
                index, last = bisect_left(bounds, value), value
            counts[index] += 1
            total += value
        self.sum = total


class FileValue(Protocol):
    """One number in this process's multiprocess file (prometheus_client's `MmapedValue`)."""

    def inc(self, amount: float) -> None: ...

    def set(self, value: float, timestamp: float | None = None) -> None: ...

    def get(self) -> float: ...


class SharedValue(Value):
    """A `Value` written through to this process's multiprocess file on every change."""

    __slots__ = ("_file", "_local")

    def __init__(self, file: FileValue) -> None:
        self._file = file
        self._local = file.get()  # a reused pid's file keeps the ended process's counts

    @property
    def value(self) -> float:
        return self._local

    @value.setter
    def value(self, value: float) -> None:
        self._local = value
        self._file.set(value)


class SharedObservations(Observations):
    """`Observations` kept in this process's multiprocess file: a count per bucket (not
    cumulative) and the sum, as prometheus_client's own Histogram keeps them."""

    __slots__ = ("_buckets", "_total")

    def __init__(
        self, bounds: tuple[float, ...], buckets: Sequence[FileValue], total: FileValue
    ) -> None:
        self._bounds = bounds
        self._buckets = buckets
        self._total = total

    def observe(self, value: float) -> None:
        self._buckets[bisect_left(self._bounds, value)].inc(1.0)
        self._total.inc(value)

    def observe_each(self, values: Iterable[float]) -> None:
        """One write per bucket hit and one for the sum, however many values."""
        hits: dict[int, int] = {}
        bounds, total = self._bounds, 0.0
        for value in values:
            index = bisect_left(bounds, value)
            hits[index] = hits.get(index, 0) + 1
            total += value
        for index, count in hits.items():
            self._buckets[index].inc(count)
        self._total.inc(total)


S = TypeVar("S", Value, Observations)


class _Family(Collector, Generic[S]):
    _type = ""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], *, shared: bool = False
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.shared = shared
        self.series: dict[tuple[str, ...], S] = {}

    def labels(self, *values: str) -> S:
        series = self.series.get(values)
        if series is None:
            series = self.series[values] = self._new(values)
        return series

    def _new(self, labelvalues: tuple[str, ...]) -> S:
        raise NotImplementedError

    def _file(
        self, sample: str, labelvalues: Sequence[str], *, le: str | None = None, mode: str = ""
    ) -> FileValue:
        """The number of one sample in this process's multiprocess file, keyed as
        prometheus_client keys it (family, sample, labels, documentation)."""
        names, labels = list(self.labelnames), list(labelvalues)
        if le is not None:
            names.append("le")
            labels.append(le)
        file: FileValue = ValueClass(
            self._type, self.name, sample, names, labels, self.documentation,
            multiprocess_mode=mode,
        )
        return file


class Counter(_Family[Value]):
    _type = "counter"

    def _new(self, labelvalues: tuple[str, ...]) -> Value:
        if self.shared:
            return SharedValue(self._file(self.name + "_total", labelvalues))
        return Value()

    def empty(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self.empty()
        for values, series in self.series.items():
            family.add_metric(list(values), series.value)
        yield family


class Gauge(_Family[Value]):
    """`mode`: how a shared gauge's series of the workers merge (prometheus_client's
    `multiprocess_mode`; the `live` modes drop a worker once `worker_exited`)."""

    _type = "gauge"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        shared: bool = False,
        mode: str = "livesum",
    ) -> None:
        super().__init__(name, documentation, labelnames, shared=shared)
        self.mode = mode

    def _new(self, labelvalues: tuple[str, ...]) -> Value:
        if not self.shared:
            return Value()
        series = SharedValue(self._file(self.name, labelvalues, mode=self.mode))
        series.value = 0.0  # this process's own number: nothing from an ended one's file
        return series

    def empty(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self.empty()
        for values, series in self.series.items():
            family.add_metric(list(values), series.value)
        yield family


class Histogram(_Family[Observations]):
    _type = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        *,
        shared: bool = False,
    ) -> None:
        super().__init__(name, documentation, labelnames, shared=shared)
        self._bounds = tuple(sorted(buckets))
        self._labels: dict[tuple[str, ...], SeriesLabels] = {}

    def _new(self, labelvalues: tuple[str, ...]) -> Observations:
        if not self.shared:
            return Observations(self._bounds)
        buckets = [
            self._file(self.name + "_bucket", labelvalues, le=edge) for edge in self._edges()
        ]
        return SharedObservations(
            self._bounds, buckets, self._file(self.name + "_sum", labelvalues)
        )

    def _edges(self) -> list[str]:
        return [*(_le(b) for b in self._bounds), "+Inf"]

    def empty(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self.empty()
        edges = self._edges()
        for values, series in self.series.items():
            running, cumulative = 0, []
            for count in series.counts:
                running += count
                cumulative.append(float(running))
            labels = self._labels.get(values)
            if labels is None:
                labels = self._labels[values] = SeriesLabels(self.labelnames, values, edges)
            add_histogram(family, labels, cumulative, series.sum)
        yield family


class SeriesLabels:
    """One histogram series' label sets, made once for every scrape: its own (`_count`, `_sum`)
    and one per bucket edge, with `le`."""

    __slots__ = ("buckets", "own")

    def __init__(self, names: Sequence[str], values: Sequence[str], edges: Sequence[str]):
        self.own = dict(zip(names, values, strict=True))
        self.buckets = [{**self.own, "le": edge} for edge in edges]


def add_histogram(
    family: Metric, labels: SeriesLabels, cumulative: Sequence[float], sum_value: float
) -> None:
    """The samples `HistogramMetricFamily.add_metric` adds for one series (`cumulative`: the
    count up to each edge, +Inf last; no negative edges), without rebuilding its label sets."""
    name, samples = family.name, family.samples
    bucket = name + "_bucket"
    samples.extend(
        Sample(bucket, with_le, count)
        for with_le, count in zip(labels.buckets, cumulative, strict=True)
    )
    samples.append(Sample(name + "_count", labels.own, cumulative[-1]))
    samples.append(Sample(name + "_sum", labels.own, sum_value))


def _le(bound: float) -> str:
    """A bucket bound as prometheus_client writes it (`le="0.005"`, `le="10.0"`)."""
    text: str = floatToGoString(bound)  # type: ignore[no-untyped-call]
    return text
