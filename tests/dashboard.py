"""The shipped Grafana dashboard (deploy/grafana-dashboard.json) and the metric names its
PromQL reads, to check them against what `/metrics` exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana-dashboard.json"

_STRING = re.compile(r'"(?:\\.|[^"\\])*"')
_MATCHERS = re.compile(r"\{[^}]*\}")  # {job=~"$job", le="0.5"}
_RANGES = re.compile(r"\[[^\]]*\]")  # [5m], [$__rate_interval], subqueries [1h:5m]
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
# A name not inside a number or another name (`5m`, `1e3`); a `(` after it makes it a function.
_NAME = re.compile(r"(?<![\w.:$])[A-Za-z_:][\w:]*(\s*\()?")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without"})
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*,")
# The series Prometheus stores for each exposed family type (text format 0.0.4).
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: functions, aggregations, keywords, label
    matchers and label lists, ranges, numbers and Grafana variables dropped."""
    text = _STRING.sub('""', expr)
    for pattern in (_MATCHERS, _RANGES, _LABEL_LISTS):
        text = pattern.sub(" ", text)
    return {
        match.group(0)
        for match in _NAME.finditer(text)
        if not match.group(1) and match.group(0) not in _KEYWORDS
    }


def panel_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel (rows' nested panels included)."""
    found = []
    pending = list(dashboard["panels"])
    while pending:
        panel = pending.pop(0)
        pending.extend(panel.get("panels", []))
        found.extend((panel["title"], target["expr"]) for target in panel.get("targets", []))
    return found


def variable_metrics(dashboard: dict[str, Any]) -> set[str]:
    """The metrics the dashboard's `label_values(metric, label)` variables read."""
    names = set()
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        names.update(_LABEL_VALUES.findall(text))
    return names


def dashboard_metrics(dashboard: dict[str, Any]) -> dict[str, set[str]]:
    """Every metric name the dashboard reads, with the panels (or variables) reading it."""
    readers: dict[str, set[str]] = {}
    for title, expr in panel_exprs(dashboard):
        for name in metric_names(expr):
            readers.setdefault(name, set()).add(title)
    for name in variable_metrics(dashboard):
        readers.setdefault(name, set()).add("(variables)")
    return readers


def sampled_names(text: str) -> set[str]:
    """The series names with at least one sample in a Prometheus text exposition."""
    return {
        sample.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def declared_names(text: str) -> set[str]:
    """The series names Prometheus would store for every family declared (`# TYPE`) in a text
    exposition, samples or not: counters `_total`, histograms `_bucket`/`_sum`/`_count`."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            base = name.removesuffix("_total") if kind == "counter" else name
            names.update(base + suffix for suffix in _SUFFIXES.get(kind, ("",)))
    return names
