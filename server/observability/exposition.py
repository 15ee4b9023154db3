"""Prometheus text format 0.0.4, byte for byte as prometheus_client's `generate_latest` writes
it, with each series' name and labels rendered once and kept for the next scrapes.

`generate_latest` validates and escapes every label of every sample on every scrape: about 4 µs
a line, and the gateway writes some 45 lines per registered adapter (its per-adapter counters,
gauges and histograms), so 128 adapters cost 20 ms of the event loop per scrape (measured).
LoRA-aware routers scrape often (the Gateway API Inference Extension's endpoint picker every
50 ms by default). Here a sample's text up to its value is looked up by its name and labels;
only the value is formatted per scrape.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.openmetrics.exposition import (
    UNDERSCORES,
    escape_label_name,
    escape_metric_name,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_OPENMETRICS_ONLY = ("_created", "_gsum", "_gcount")  # moved to gauges of their own, at the end
_PROMETHEUS_TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram",
                     "unknown": "untyped"}
_MAX_HEADS = 200_000  # series heads kept; past that the cache starts over (adapters come and go)
_MAX_VALUES = 10_000  # value texts kept (counts repeat; sums and times rarely do)

SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


class Collecting(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class Exposition:
    """Renders collectors as `generate_latest(collector)` does; one per `/metrics` route."""

    def __init__(self) -> None:
        self._heads: dict[SeriesKey, str] = {}
        self._values: dict[float, str] = {}

    def latest(self, collector: Collecting) -> bytes:
        out: list[str] = []
        for metric in collector.collect():
            self._family(metric, out)
        return "".join(out).encode("utf-8")

    def _family(self, metric: Metric, out: list[str]) -> None:
        name, kind = metric.name, metric.type
        if kind == "counter":
            name += "_total"
        elif kind == "info":
            name += "_info"
        out.append(_help_and_type(name, _PROMETHEUS_TYPES.get(kind, kind), metric.documentation))
        moved: dict[str, list[str]] = {}
        openmetrics_only = {metric.name + suffix: suffix for suffix in _OPENMETRICS_ONLY}
        for sample in metric.samples:
            suffix = openmetrics_only.get(sample.name)
            if suffix is None:
                out.append(self._line(sample))
            else:
                moved.setdefault(suffix, []).append(self._line(sample))
        for suffix, lines in sorted(moved.items()):
            out.append(_help_and_type(metric.name + suffix, "gauge", metric.documentation))
            out.extend(lines)

    def _line(self, sample: Sample) -> str:
        key = (sample.name, tuple(sample.labels.items()))
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= _MAX_HEADS:
                self._heads.clear()
            head = self._heads[key] = _head(sample)
        if sample.timestamp is not None:
            return f"{head}{self._value(sample.value)} {int(float(sample.timestamp) * 1000):d}\n"
        return f"{head}{self._value(sample.value)}\n"

    def _value(self, value: float) -> str:
        if value == 0:  # 0.0 and -0.0 are one key of the cache but two texts
            return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
        text = self._values.get(value)
        if text is None:
            if len(self._values) >= _MAX_VALUES:
                self._values.clear()
            text = self._values[value] = floatToGoString(value)  # type: ignore[no-untyped-call]
        return text


def _help_and_type(name: str, kind: str, documentation: str) -> str:
    escaped = escape_metric_name(name, UNDERSCORES)
    doc = documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {escaped} {doc}\n# TYPE {escaped} {kind}\n"


def _head(sample: Sample) -> str:
    """`name{label="value",...} `: labels sorted by name, names escaped to Prometheus' legacy
    characters, values with backslash, newline and quote escaped."""
    name = escape_metric_name(sample.name, UNDERSCORES)
    if not sample.labels:
        return f"{name} "
    labels = ",".join(
        f'{escape_label_name(key, UNDERSCORES)}="{_escaped(value)}"'
        for key, value in sorted(sample.labels.items())
    )
    return f"{name}{{{labels}}} "


def _escaped(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
