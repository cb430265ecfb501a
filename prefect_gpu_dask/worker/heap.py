"""Short full garbage collections on a worker: what the worker process keeps for good
(its imports, the libraries its first tasks load) is frozen out of them.

Python's full collections scan every object the process tracks. On a worker that has
loaded Prefect, Dask and a GPU library, one stalls the task running at the time for
about 200 ms, every dozen or so tasks (``benchmarks/probes/gc_pauses.py``).
``WorkerHeap``, a small ``WorkerPlugin`` the runner registers on every cluster it uses,
looks every few seconds: when the worker runs no task and has imported modules since
it last froze, it collects, then freezes (``gc.freeze``), so later full collections
skip what was there. Collecting first freezes no garbage. What is frozen and later
becomes garbage in a reference cycle is never collected: for a process's imports and
long-lived state that costs nothing, and a task's own objects are never frozen while
it runs.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from typing import Any

from distributed import WorkerPlugin

logger = logging.getLogger(__name__)

CHECK_S = 2.0


def freeze_due(modules: int, modules_at_last_freeze: int, executing: int) -> bool:
    """Whether to collect and freeze now: new modules since the last freeze, no task running."""
    return modules > modules_at_last_freeze and executing == 0


class WorkerHeap(WorkerPlugin):
    name = "prefect-gpu-dask-heap"
    idempotent = True

    def __init__(self, check_s: float = CHECK_S):
        if not check_s > 0:
            raise ValueError(f"check_s must be a positive number of seconds, got {check_s!r}")
        self.check_s = check_s
        self.freezes = 0
        self._modules_at_last_freeze = 0
        self._worker: Any = None
        self._callback: Any = None

    async def setup(self, worker: Any) -> None:
        from tornado.ioloop import PeriodicCallback

        self._worker = worker
        self._callback = PeriodicCallback(self.check, self.check_s * 1000)
        self._callback.start()

    async def teardown(self, worker: Any) -> None:
        if self._callback is not None:
            self._callback.stop()

    def check(self) -> None:
        modules = len(sys.modules)
        if not freeze_due(modules, self._modules_at_last_freeze, self._worker.state.executing_count):
            return
        started = time.perf_counter()
        gc.collect()
        gc.freeze()
        self._modules_at_last_freeze = modules
        self.freezes += 1
        logger.debug(
            "Froze %d objects out of full collections (%d modules) in %.0f ms",
            gc.get_freeze_count(),
            modules,
            1e3 * (time.perf_counter() - started),
        )

    def __getstate__(self) -> dict[str, Any]:  # sent to workers before setup: nothing live
        return {"check_s": self.check_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["check_s"])
