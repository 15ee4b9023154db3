"""Live scheduler numbers from vLLM: a stat logger added next to vLLM's own Prometheus logger
copies each step's scheduler stats into a `SchedulerSnapshot` the engine reads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import SchedulerStats


class SchedulerSnapshot:
    """The latest scheduler numbers vLLM reported (updated on the event loop after each step),
    and the requests each front end has in the engine. With several front ends `values` is
    memory they share: vLLM reports scheduler numbers to one front end per step."""

    __slots__ = ("_mine", "_values")

    def __init__(self, values: Any = None, index: int = 0) -> None:
        self._values = values if values is not None else [0.0] * (STATS + 1)
        self._mine = STATS + index  # this front end's count of requests in the engine

    @property
    def running(self) -> int:
        return int(self._values[0])

    @property
    def waiting(self) -> int:
        return int(self._values[1])

    @property
    def kv_cache_usage(self) -> float:
        return float(self._values[2])

    def update(self, stats: SchedulerStats) -> None:
        values = self._values
        values[0] = stats.num_running_reqs
        values[1] = stats.num_waiting_reqs + stats.num_skipped_waiting_reqs
        values[2] = stats.kv_cache_usage

    def entered(self, count: int) -> None:
        self._values[self._mine] += count

    def idle(self) -> bool:
        """No front end has a request in the engine. The engine reports numbers only after a
        step; after an abort it goes idle without one, so the last numbers would still count
        the aborted request."""
        return sum(self._values[STATS:]) <= 0


STATS = 3  # running, waiting, KV cache usage; then one count per front end


def snapshot_logger(snapshot: SchedulerSnapshot) -> type[StatLoggerBase]:
    """A vLLM per-engine stat logger class that copies scheduler stats into `snapshot`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SnapshotStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: SchedulerStats | None,
            iteration_stats: object,
            mm_cache_stats: object = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                snapshot.update(scheduler_stats)

        def log_engine_initialized(self) -> None:
            return None

    return SnapshotStatLogger
