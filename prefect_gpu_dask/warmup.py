"""Import Prefect on each worker in the background, while the flow gets going.

A fresh worker process that meets its first Prefect task would import Prefect's task
engine right then (about two seconds on the GPU machine). ``WarmImports`` starts that
import in a daemon thread as soon as the worker joins, so the cluster is ready at once
and the first task finds the engine loaded. Python's import lock makes a task that
arrives mid-import wait for the same import rather than start a second one.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Iterable
from typing import Any

from distributed import WorkerPlugin

logger = logging.getLogger("prefect_gpu_dask.warmup")

# What a worker needs to run a task run: the submission path pulls in the task engine.
TASK_ENGINE_MODULES = ("prefect_gpu_dask.submission",)


class WarmImports(WorkerPlugin):
    """Worker plugin: import ``modules`` in a background thread on every worker."""

    name = "prefect-gpu-dask-warm-imports"
    idempotent = True

    def __init__(self, modules: Iterable[str] = TASK_ENGINE_MODULES):
        self.modules = tuple(modules)
        for module in self.modules:
            if not isinstance(module, str) or not module:
                raise ValueError(f"module {module!r} is not a module name")
        self.thread: threading.Thread | None = None

    def setup(self, worker: Any) -> None:
        self.thread = threading.Thread(target=self._import_all, name="warm-imports", daemon=True)
        self.thread.start()

    def _import_all(self) -> None:
        for module in self.modules:
            try:
                importlib.import_module(module)
            except Exception as exc:  # the task that needs it will raise it properly
                logger.debug("Could not pre-import %s: %s", module, exc)
