"""`Exposition` writes what prometheus_client's `generate_latest` writes, scrape after scrape."""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.samples import Sample

from server.observability.exposition import Exposition
from server.observability.families import SeriesLabels, add_histogram

ODD_VALUES = [0.0, -0.0, 1.0, 7, -2.5, 0.1, 1e22, 123456789.0, 1234567.5, 5e-324,
              math.inf, -math.inf, math.nan]


class Families:
    def __init__(self, step: int) -> None:
        self.step = step

    def collect(self) -> Iterable[Metric]:
        step = self.step
        counter = CounterMetricFamily("gateway_adapter_requests", "Requests.\nTwo \\ lines.",
                                      labels=["adapter"])
        for index, name in enumerate(["a1", 'quote"d', "back\\slash", "new\nline", "ünï"]):
            counter.add_metric([name], float(index * step))
        yield counter
        yield CounterMetricFamily("made", "With a created time.", value=3.0, created=1700000000.5)
        yield GaugeMetricFamily("vllm:num_requests_running", "Running.", value=float(step))
        odd = GaugeMetricFamily("odd_values", "Every kind of float.", labels=["i", "bad-name"])
        for index, value in enumerate(ODD_VALUES):
            odd.add_metric([str(index), "x"], value * (1 if step % 2 else -1))
        yield odd
        histogram = HistogramMetricFamily("load_seconds", "Loads.", labels=["adapter"])
        histogram.add_metric(["a1"], [("0.1", 1.0), ("1.0", float(step)), ("+Inf", 9.0)],
                             sum_value=4.25 * step)
        yield histogram
        yield SummaryMetricFamily("waits", "Waits.", count_value=step, sum_value=0.5)
        yield InfoMetricFamily("build", "Build.", value={"version": "1.0", "commit": "abc"})
        stamped = Metric("stamped", "With a timestamp.", "unknown")
        stamped.samples.append(Sample("stamped", {"z": "1", "a": "2"}, 1.5, 1700000000.25))
        yield stamped
        yield Metric("no_samples", "Empty.", "gauge")


def test_every_scrape_matches_generate_latest() -> None:
    exposition = Exposition()
    for step in (1, 2, 2, 5):
        families = Families(step)
        assert exposition.latest(families) == generate_latest(families)  # type: ignore[arg-type]


def test_series_that_come_and_go_are_written_from_their_own_labels() -> None:
    exposition = Exposition()
    first = GaugeMetricFamily("g", "G.", labels=["adapter"])
    first.add_metric(["x"], 1.0)
    second = GaugeMetricFamily("g", "G.", labels=["adapter"])
    second.add_metric(["y"], 1.0)
    for family in (first, second, first):
        collector = _One(family)
        assert exposition.latest(collector) == generate_latest(collector)  # type: ignore[arg-type]


class _One:
    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> Iterable[Metric]:
        yield self.family


def test_a_histogram_series_from_kept_labels_is_what_add_metric_adds() -> None:
    kept = HistogramMetricFamily("h", "H.", labels=["adapter", "kind"])
    plain = HistogramMetricFamily("h", "H.", labels=["adapter", "kind"])
    labels = SeriesLabels(("adapter", "kind"), ("a1", "x"), ["0.1", "1.0", "+Inf"])
    for _ in range(2):  # the same label sets serve every scrape
        add_histogram(kept, labels, [1.0, 2.0, 4.0], 3.5)
        plain.add_metric(["a1", "x"], [("0.1", 1.0), ("1.0", 2.0), ("+Inf", 4.0)], sum_value=3.5)
    assert kept.samples == plain.samples
