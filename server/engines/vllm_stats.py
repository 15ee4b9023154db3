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
    and per front end its requests in the engine and the engine steps it was told of. With
    several front ends `values` is memory they share: vLLM reports each step to one of them.

    Steps are counted only where a single front end serves the engine (`start_llm`: with
    several, adapters settle by time alone); the slots are per front end all the same, each
    written by its own process only and summed on reading, so that counting with several front
    ends would lose no increment and never go back."""

    __slots__ = ("_mine", "_values")

    def __init__(self, values: Any = None, index: int = 0) -> None:
        self._values = values if values is not None else [0.0] * size(1)
        self._mine = STATS + FRONT_END_SLOTS * index  # this front end's requests, then steps

    @property
    def running(self) -> int:
        return int(self._values[0])

    @property
    def waiting(self) -> int:
        return int(self._values[1])

    @property
    def kv_cache_usage(self) -> float:
        return float(self._values[2])

    @property
    def steps(self) -> int:
        """Engine steps reported to all front ends so far."""
        return int(sum(self._values[STATS + 1 :: FRONT_END_SLOTS]))

    def update(self, stats: SchedulerStats) -> None:
        values = self._values
        values[0] = stats.num_running_reqs
        values[1] = stats.num_waiting_reqs + stats.num_skipped_waiting_reqs
        values[2] = stats.kv_cache_usage

    def stepped(self) -> None:
        self._values[self._mine + 1] += 1

    def entered(self, count: int) -> None:
        self._values[self._mine] += count

    def idle(self) -> bool:
        """No front end has a request in the engine. The engine reports numbers only after a
        step; after an abort it goes idle without one, so the last numbers would still count
        the aborted request."""
        return sum(self._values[STATS::FRONT_END_SLOTS]) <= 0


STATS = 3  # running, waiting, KV cache usage; then FRONT_END_SLOTS per front end
FRONT_END_SLOTS = 2  # requests in the engine, engine steps reported to it


def size(front_ends: int) -> int:
    """Length of the values a snapshot shared by `front_ends` front ends needs."""
    return STATS + FRONT_END_SLOTS * front_ends


def snapshot_logger(snapshot: SchedulerSnapshot, *, count_steps: bool) -> type[StatLoggerBase]:
    """A vLLM per-engine stat logger class that copies scheduler stats into `snapshot`.

    vLLM's scheduler attaches stats to the outputs of every step it completes
    (`Scheduler.update_from_output`, to one front end even when the step had no output), so
    each stats report is one finished step. `count_steps`: only for one engine core (data
    parallel cores step independently, and idle ones report dummy batches)."""
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
                if count_steps:
                    snapshot.stepped()

        def log_engine_initialized(self) -> None:
            return None

    return SnapshotStatLogger
