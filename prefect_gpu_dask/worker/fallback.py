"""A task run's routing fallback, announced or enforced where it runs.

When no worker offered what a task asked for (``flow.routing``), ``falling_back`` is the
``around`` that warns in the task run (``on_missing_gpu="cpu"``) or fails it
(``"error"``), unless the worker running it offers the resources after all (the one the
task waited for joined in time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from prefect_gpu_dask._compat import current_worker, worker_resources
from prefect_gpu_dask.errors import MissingResourceError
from prefect_gpu_dask.resources import satisfiable


def falling_back(
    message: str, fail: bool, unless_offered: Mapping[str, float] | None = None
) -> Callable[[], AbstractContextManager[None]]:
    """An ``around`` that announces a routing fallback in the task run, or fails it.

    With ``unless_offered``, a worker that offers those resources (the one the task
    waited for joined in time) runs the task as asked, without a word.
    """

    @contextmanager
    def announce() -> Any:
        if unless_offered is not None and satisfiable(unless_offered, [_worker_resources()]):
            yield
            return
        if fail:
            raise MissingResourceError(message)
        from prefect.logging import get_run_logger

        get_run_logger().warning(message)
        yield

    return announce


def _worker_resources() -> Mapping[str, float]:
    worker = current_worker()
    return worker_resources(worker) if worker is not None else {}
