"""Prometheus multiprocess mode, for several front-end worker processes over one engine core
(`ServerConfig.workers` > 1), the way `vllm serve --api-server-count N` does it.

The supervisor makes an empty directory and sets `PROMETHEUS_MULTIPROC_DIR` to it before it
spawns the workers, so prometheus_client (which picks its value class at import) writes every
metric of a worker to that worker's files there: vLLM's `vllm:` families and the gateway's
families made with `shared=True` (server/observability/families.py). The worker answering a
scrape merges every worker's files with prometheus_client's `MultiProcessCollector`: counters
and histograms summed, gauges by their `multiprocess_mode`. When a worker ends, the supervisor
calls `worker_exited(pid)`: its live gauges (`live*` modes) leave the sums, its counters and
histograms stay, so totals never go back.

Families named `gateway_internal_*` carry what a worker's scrape-time numbers need from the
others (per-adapter queues, MindIE's windows); they are never exposed. As vLLM does, the
default registry's per-process `process_*` and `python_*` families are not served then (a
scrape answered by another worker would make them jump).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Sequence

from prometheus_client import multiprocess
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.values import ValueClass

from server.observability.families import Counter, Gauge, Histogram

ENV = "PROMETHEUS_MULTIPROC_DIR"
INTERNAL = "gateway_internal_"


def _environ_dir() -> str | None:
    """prometheus_client's own variable (not gateway configuration: the supervisor sets it for
    prometheus_client, which reads it itself)."""
    return os.environ.get(ENV)  # noqa: TID251


def multiprocess_dir() -> str | None:
    """The directory this process writes its metrics to, or None (one process)."""
    path = _environ_dir()
    if path is None:
        return None
    if not getattr(ValueClass, "_multiprocess", False):
        raise RuntimeError(
            f"{ENV} was set after prometheus_client was imported: this process's metrics "
            "would not reach the shared files (set it before the worker starts)"
        )
    return path


def worker_exited(pid: int) -> None:
    """Drop the live gauges of the ended worker `pid` (its in-flight and queued requests, its
    MindIE window); its counters and histograms stay. A no-op with one process."""
    path = _environ_dir()
    if path:
        multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]


def merged(path: str, pattern: str = "*.db") -> Iterable[Metric]:
    """The families in the files of every worker matching `pattern`, merged."""
    files = glob.glob(os.path.join(path, pattern))
    metrics: Iterable[Metric] = multiprocess.MultiProcessCollector.merge(files)  # type: ignore[no-untyped-call]
    return metrics


def live_sums(path: str) -> dict[str, dict[tuple[str, ...], float]]:
    """Every `livesum` gauge summed over the live workers: family → label values (in label
    name order) → sum."""
    return {
        metric.name: {tuple(s.labels.values()): s.value for s in metric.samples}
        for metric in merged(path, "gauge_livesum_*.db")
    }


class SharedFiles(Collector):
    """What every worker wrote, merged (`vllm:` and the shared `gateway_*` families; internal
    ones left out). A `declared` family no worker has a series of yet is declared empty, as one
    process declares it."""

    def __init__(self, path: str, declared: Sequence[Counter | Gauge | Histogram]) -> None:
        self._path = path
        self._declared = declared

    def collect(self) -> Iterable[Metric]:
        seen = set()
        for metric in merged(self._path):
            if not metric.name.startswith(INTERNAL):
                seen.add(metric.name)
                yield metric
        for family in self._declared:
            if family.name not in seen:
                yield family.empty()
