"""Starting vLLM: one `AsyncLLM` in this process, or, for several front-end processes, the engine
core started once in the supervisor (`CoreLaunch`) with one client place per front end."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from server.engines.vllm_options import VllmEngineOptions
from server.engines.vllm_stats import SchedulerSnapshot, size, snapshot_logger

if TYPE_CHECKING:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerFactory


def import_vllm() -> None:
    import vllm.v1.engine.async_llm  # noqa: F401


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def engine_args(options: VllmEngineOptions) -> AsyncEngineArgs:
    """vLLM's arguments from our options, structured output on xgrammar unless the options name
    a backend. vLLM's `auto` checks each request with xgrammar and, where xgrammar refuses it,
    with guidance; but the engine compiles every request with the one backend the first
    structured request chose (vllm/v1/structured_output/__init__.py). A grammar only guidance
    takes then failed inside the engine: a 500 for a bad request. One backend checks and
    compiles: such a request is a 400 ("Invalid grammar specification.")."""
    from vllm import AsyncEngineArgs

    args = AsyncEngineArgs(**options.engine_kwargs())
    config = args.structured_outputs_config
    if getattr(config, "backend", None) == "auto":
        config.backend = "xgrammar"
    return args


def start_llm(
    options: VllmEngineOptions, snapshot: SchedulerSnapshot, client: ClientPlace | None
) -> AsyncLLM:
    from vllm.v1.engine.async_llm import AsyncLLM

    args = engine_args(options)
    # A custom per-engine logger is added to vLLM's defaults, so its Prometheus logger
    # (the `vllm:` families in prometheus_client's REGISTRY) stays active.
    # Steps settle adapters only with one front end: with several, a worker's abort and the
    # owner's remove_lora reach the engine core on different sockets, in no guaranteed order,
    # so the time rule (settle_s) keeps its margin there.
    one_front_end = client is None and options.data_parallel_size == 1
    loggers: list[StatLoggerFactory] = [snapshot_logger(snapshot, count_steps=one_front_end)]
    if client is None:
        return AsyncLLM.from_engine_args(args, stat_loggers=loggers)
    # as vLLM's build_async_engine_client does for each of its API servers
    args._api_process_count = client.count
    args._api_process_rank = client.index
    return AsyncLLM.from_vllm_config(
        args.create_engine_config(),
        stat_loggers=loggers,
        client_addresses=dict(client.addresses),
        client_count=client.count,
        client_index=client.index,
    )


@dataclass(frozen=True, slots=True)
class ClientPlace:
    """One front end's place among `count` clients of an engine core started elsewhere: the
    ZMQ listeners and addresses vLLM's launcher made for it (passed to a spawned process)."""

    addresses: Mapping[str, Any]
    count: int
    index: int
    stats: Any  # a multiprocessing RawArray all front ends share (SchedulerSnapshot)


class CoreLaunch:
    """The engine core (and vLLM's DP coordinator when data parallel) started once, in the
    supervisor, for `count` front ends: vLLM's own multi-API-server launch
    (`vllm serve --api-server-count`, vllm/entrypoints/cli/serve.py), driven from our options."""

    def __init__(self, options: VllmEngineOptions, count: int) -> None:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.utils import bind_engine_zmq_listeners

        args = engine_args(options)
        args._api_process_count = count
        args._api_process_rank = -1
        self._config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        self._log_stats = not args.disable_log_stats
        self._listeners: Any = bind_engine_zmq_listeners(self._config, count)
        self.engine_manager: Any = None
        self.coordinator: Any = None
        self._launch: Any = None

    @contextlib.contextmanager
    def start(self) -> Iterator[list[ClientPlace]]:
        """Start the engine core; the body starts the front ends with the places it gets
        (each listener goes to one process). Leaving the body waits until the engine is up."""
        from vllm.v1.engine.utils import launch_core_engines
        from vllm.v1.executor import Executor

        listeners = self._listeners
        with launch_core_engines(
            self._config, Executor.get_class(self._config), self._log_stats, listeners.addresses
        ) as launch:
            self._launch = launch
            self.engine_manager, self.coordinator = launch.engine_manager, launch.coordinator
            stats = self.coordinator.get_stats_publish_address() if self.coordinator else None
            count = len(listeners.inputs)
            shared = multiprocessing.get_context("spawn").RawArray("d", size(count))
            places = [
                ClientPlace(client_addresses(inp, out, stats), count, index, shared)
                for index, (inp, out) in enumerate(zip(listeners.inputs, listeners.outputs,
                                                       strict=True))
            ]
            yield places
            for listener in (*listeners.inputs, *listeners.outputs):
                listener.close()  # the front ends hold them now

    def watch(self, processes: Sequence[Any]) -> None:
        """Front ends whose death while the engine starts aborts the start (as vLLM's)."""
        self._launch.watched_frontend_processes = processes

    def sentinels(self) -> list[int]:
        """Process sentinels of the engine core(s) and the coordinator, to watch for death."""
        procs = list(getattr(self.engine_manager, "processes", []) or [])
        if self.coordinator is not None:
            procs.append(self.coordinator.proc)
        return [proc.sentinel for proc in procs]

    def shutdown(self, timeout: float | None) -> None:
        self._listeners.cleanup()  # ipc:// files
        self._listeners = None  # its __del__ cleans up again: now, not at interpreter exit
        if self.engine_manager is not None:
            self.engine_manager.shutdown(timeout=timeout)
        if self.coordinator is not None:
            self.coordinator.shutdown(timeout=timeout)


def client_addresses(inp: Any, out: Any, stats: str | None) -> dict[str, Any]:
    """What vLLM's APIServerProcessManager hands each API server (vllm/v1/utils.py)."""
    addresses: dict[str, Any] = {
        "input_address": inp.address,
        "output_address": out.address,
        "input_listener": inp.socket,
        "output_listener": out.socket,
    }
    if stats is not None:
        addresses["stats_update_address"] = stats
    return addresses
