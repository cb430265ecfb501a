"""Short full garbage collections on a worker: what the worker process keeps for good
(its imports, the libraries its first tasks load) is frozen out of them.

Python's full collections scan every object the process tracks. On a worker that has
loaded Prefect, Dask and a GPU library, one stalls the task running at the time for
about 200 ms, every dozen or so tasks (``benchmarks/probes/gc_pauses.py``).
``WorkerHeap``, a small ``WorkerPlugin`` the runner registers on every cluster it uses,
collects once and freezes (``gc.freeze``) when it is set up, and again whenever the
worker's last running task ends with modules imported since (the libraries a first
task loads), so later full collections skip what was there. Collecting first freezes
no garbage. What is frozen and later becomes garbage in a reference cycle is never
collected: for a process's imports and long-lived state that costs nothing, and a
task's own objects are never frozen while it runs. A worker forked from this package's
fork server starts with the server's heap frozen already (``fork_server_heap``), so its
first collection here is short. A worker without a nanny may share
its process with the flow (``LocalCluster(processes=False)``): that process is the
user's, so such a worker is left as it is.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from typing import Any

from distributed import WorkerPlugin

logger = logging.getLogger(__name__)


def freeze_due(modules: int, modules_at_last_freeze: int, executing: int) -> bool:
    """Whether to collect and freeze now: new modules since the last freeze, no task running."""
    return modules > modules_at_last_freeze and executing == 0


class WorkerHeap(WorkerPlugin):
    name = "prefect-gpu-dask-heap"
    idempotent = True

    def __init__(self) -> None:
        self.freezes = 0
        self._modules_at_last_freeze = 0
        self._worker: Any = None

    async def setup(self, worker: Any) -> None:
        if worker.nanny is None:  # maybe in the flow's own process
            return
        self._worker = worker
        self.check()

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        # On the worker's event loop, inside its state machine: judged just after.
        if start == "executing" and self._worker is not None:
            self._worker.loop.add_callback(self.check)

    def check(self) -> None:
        if self._worker is None:
            return
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
