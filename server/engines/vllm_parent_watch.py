"""A vLLM general plugin: vLLM's engine core stops once the process that started it is gone.

The engine core is a multiprocessing child of the process that started the engine: the gateway,
or with `workers` > 1 the supervisor. vLLM's own workers watch the engine core (a pipe that
closes when it dies), but nothing watches the engine core's parent: a gateway killed with SIGKILL
(the OOM killer, `kill -9`) left the engine core, its worker and the model's memory running with
nobody to serve them (measured), and on a GPU that memory keeps a restarted gateway from starting.

vLLM loads every `vllm.general_plugins` entry point (pyproject.toml) in each process it runs:
the front end, the engine core and each worker. `install` acts only in the engine core process:
a daemon thread compares this process's parent with the one that started it, once a second, and
when they differ it stops the engine core as a SIGTERM would (vLLM's own shutdown), then kills
it if that has not ended it within `TERM_GRACE_S`. Only the standard library is used here.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable

POLL_S = 1.0
TERM_GRACE_S = 10.0
_watching = False


def install() -> None:
    """The entry point: start the watch in vLLM's engine core process, nowhere else."""
    global _watching
    parent = multiprocessing.parent_process()
    if _watching or parent is None or parent.pid is None:
        return
    if not is_engine_core(multiprocessing.current_process().name):
        return
    _watching = True
    threading.Thread(
        target=watch_parent, args=(parent.pid, _stop_self), name="gateway-parent-watch",
        daemon=True,
    ).start()


def is_engine_core(process_name: str) -> bool:
    """vLLM names its engine core process "EngineCore" ("EngineCore_DP<n>" with data parallel)."""
    return process_name == "EngineCore" or process_name.startswith("EngineCore_DP")


def watch_parent(parent: int, stop: Callable[[], None], poll_s: float = POLL_S) -> None:
    """Return once this process's parent is no longer `parent` (it died and this process was
    adopted), after calling `stop`."""
    while os.getppid() == parent:
        time.sleep(poll_s)
    logging.getLogger("gateway").error(
        "the process that started the engine (pid %d) is gone: stopping the engine core", parent
    )
    stop()


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(TERM_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)
